r"""The convergence test on the training objective that ``convergence_tol`` turns on.

A deterministic objective (DVI on full batches) has no gradient noise, so "the loss stopped
moving" is a usable stopping rule: after epoch :math:`e` with mean training loss :math:`L_e`,
training stops when

.. math::
    |L_e - L_{e-1}| \le \text{tol}\cdot\max(1, |L_e|),

counted only between epochs that both ran at the KL schedule's final weight (a warm-up changes
the objective, so a flat loss during it means nothing). L-BFGS's own per-step tests (largest
gradient entry below ``1e-7``, loss change below ``1e-9``) end a step early; the next epoch then
leaves the loss where it was and this test fires.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._validation import positive_float

__all__ = ["ObjectiveConvergence"]


class ObjectiveConvergence:
    """Accumulates an epoch's training loss on the device and decides, once per epoch, to stop.

    Args:
        tol: relative tolerance, ``> 0``; ``None`` turns the test off.
    """

    def __init__(self, tol: float | None) -> None:
        self.tol = None if tol is None else positive_float("convergence_tol", tol)
        self.converged = False
        self._sum: Tensor | None = None
        self._count = 0
        self._previous: float | None = None

    @property
    def enabled(self) -> bool:
        """Whether a tolerance was given."""
        return self.tol is not None

    def reset(self) -> None:
        """Forget the previous epochs (a new fit)."""
        self.converged = False
        self._sum, self._count, self._previous = None, 0, None

    def add(self, loss: Tensor) -> None:
        """Add one batch's loss (no host synchronisation: the sum stays on the device)."""
        value = loss.detach().to(torch.float64)
        self._sum = value if self._sum is None else self._sum + value
        self._count += 1

    def epoch_end(self, at_final_weight: bool) -> bool:
        """Close the epoch (one host read); ``True`` when the objective has converged."""
        if self._sum is None or self.tol is None:
            return False
        value = float(self._sum) / self._count
        self._sum, self._count = None, 0
        previous, self._previous = self._previous, (value if at_final_weight else None)
        if previous is None or not math.isfinite(value):
            return False
        return abs(value - previous) <= self.tol * max(1.0, abs(value))
