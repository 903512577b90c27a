"""A callback for ``tests/test_resume_cli.py``: holds a real ``lightning-dvi fit`` mid-step.

It is passed on the command line (``--trainer.callbacks+=...``) of the run that the test then
kills with SIGKILL, so the kill lands at a known point instead of at a moment that depends on
how busy the machine is: inside epoch ``epoch``'s L-BFGS step (the toy recipe trains one
full-batch step per epoch), just before the backward pass of its ``evaluation``-th loss
evaluation. The line search has then moved the parameters and the step's curvature pairs are
half built, while ``last.ckpt`` still holds the end of the previous epoch.
"""

from __future__ import annotations

import time
from pathlib import Path

from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor


class PauseMidStep(Callback):
    """Write ``flag`` (the global step) and sleep at loss evaluation ``evaluation`` of ``epoch``.

    Args:
        epoch: the epoch (0-based) to hold.
        evaluation: which of that epoch's loss evaluations (1-based; an L-BFGS step evaluates
            the loss once per line-search trial) to hold before its backward pass.
        flag: the file written when the run is held.
    """

    def __init__(self, epoch: int, evaluation: int, flag: str) -> None:
        self.epoch, self.evaluation, self.flag = epoch, evaluation, flag
        self.seen = 0

    def on_before_backward(
        self, trainer: Trainer, pl_module: LightningModule, loss: Tensor
    ) -> None:
        if trainer.current_epoch != self.epoch:
            return
        self.seen += 1
        if self.seen == self.evaluation:
            Path(self.flag).write_text(str(trainer.global_step))
            time.sleep(600)  # the test kills the process long before this ends
