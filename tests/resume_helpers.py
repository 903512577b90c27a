"""A callback for ``tests/test_resume_cli.py``: holds a real ``lightning-dvi fit`` mid-epoch.

It is passed on the command line (``--trainer.callbacks+=...``) of the run that the test then
kills with SIGKILL, so the kill lands at a known point (epoch ``epoch``, after batch ``batch``:
after that epoch's predecessor wrote its checkpoint, with steps of the current epoch done and
not saved) instead of at a moment that depends on how busy the machine is.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer


class PauseMidEpoch(Callback):
    """Write ``flag`` (the global step) and sleep, after batch ``batch`` of epoch ``epoch``."""

    def __init__(self, epoch: int, batch: int, flag: str) -> None:
        self.epoch, self.batch, self.flag = epoch, batch, flag

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.current_epoch == self.epoch and batch_idx == self.batch:
            Path(self.flag).write_text(str(trainer.global_step))
            time.sleep(600)  # the test kills the process long before this ends
