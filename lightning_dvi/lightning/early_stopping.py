"""``RestoreBestWeights``: keep, in memory, the weights of the best validation epoch, and restore them.

Lightning's ``EarlyStopping`` stops a run once a monitored value has not improved for
``patience`` validations, but leaves the model at its last weights, ``patience`` epochs past
the best ones; ``ModelCheckpoint`` would write every improvement to disk. This callback copies
the module's ``state_dict`` whenever the monitored value improves and loads the best copy back
when fitting ends, so early stopping on a validation carve-out costs one in-memory copy per
improvement. The best copy also goes into the checkpoints' callback state, so a fit resumed
with ``ckpt_path`` still ends on the best weights of the whole run.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import Tensor

__all__ = ["RestoreBestWeights"]


class RestoreBestWeights(Callback):
    """Restore the weights of the epoch with the best ``monitor`` value when ``fit`` ends.

    Args:
        monitor: a logged validation value, e.g. ``"val/nll"``.
        mode: ``"min"`` or ``"max"``: which direction is better.

    Attributes:
        best_score: the best value seen (``None`` before the first validation).
        best_epoch: the epoch it was logged at.
    """

    def __init__(self, monitor: str = "val/nll", mode: Literal["min", "max"] = "min") -> None:
        if mode not in ("min", "max"):
            raise ValueError(f"mode must be 'min' or 'max', got {mode!r}")
        self.monitor, self.mode = monitor, mode
        self.best_score: float | None = None
        self.best_epoch: int | None = None
        self._best_state: dict[str, Tensor] | None = None
        self._resumed = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Forget a previous fit's best weights (not those a resumed checkpoint brought back)."""
        if not self._resumed:
            self.best_score, self.best_epoch, self._best_state = None, None, None
        self._resumed = False

    def state_dict(self) -> dict[str, Any]:
        """The best value, its epoch and its weights, so a resumed fit restores the whole run's best.

        Saved in the checkpoint's callback state (tensors, a float and an int: it loads with
        ``weights_only=True``); without it a run resumed after its best epoch would end on the
        best epoch seen since the resume.
        """
        return {
            "best_score": self.best_score,
            "best_epoch": self.best_epoch,
            "best_state": self._best_state,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take back what :meth:`state_dict` saved (``fit(ckpt_path=...)`` calls it)."""
        self.best_score = state_dict["best_score"]
        self.best_epoch = state_dict["best_epoch"]
        self._best_state = state_dict["best_state"]
        self._resumed = True

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Copy the weights if the monitored value improved (only finite values count)."""
        if trainer.sanity_checking or self.monitor not in trainer.callback_metrics:
            return
        value = float(trainer.callback_metrics[self.monitor])
        if not math.isfinite(value):
            return
        better = self.best_score is None or (
            value < self.best_score if self.mode == "min" else value > self.best_score
        )
        if better:
            self.best_score, self.best_epoch = value, trainer.current_epoch
            with torch.no_grad():
                self._best_state = {
                    k: v.detach().clone() for k, v in pl_module.state_dict().items()
                }

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Load the best weights back into the module."""
        if self._best_state is not None:
            pl_module.load_state_dict(self._best_state)
