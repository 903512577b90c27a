r"""Classification metrics for predictive class probabilities, as torchmetrics ``Metric`` classes.

Updated with ``update(probs, target)``: ``probs [B, K]`` (rows summing to one) and integer
labels ``target [B]``. Accuracy and expected calibration error are torchmetrics' own
(``MulticlassAccuracy`` with micro averaging, ``MulticlassCalibrationError``); this module adds
the NLL and the Brier score with sum states, and a collection that validates inputs once.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric, MetricCollection
from torchmetrics.classification import MulticlassAccuracy, MulticlassCalibrationError
from torchmetrics.utilities import dim_zero_cat

from .functional import (
    categorical_brier,
    categorical_nll,
    check_probabilities,
    reliability_bins,
)

__all__ = [
    "BrierScore",
    "ClassificationMetrics",
    "ClassificationNLL",
    "ExpectedCalibrationError",
    "classification_metrics",
]


class _MeanOfClassScores(Metric):
    """Mean over points of a per-point score of ``(probs, target)``."""

    full_state_update = False
    is_differentiable = True
    higher_is_better = False
    _state: str

    def __init__(self, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validate_args = validate_args
        # Distinct state names keep MetricCollection's compute groups from merging two scores.
        self.add_state(f"{self._state}_sum", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state(f"{self._state}_count", torch.tensor(0), dist_reduce_fx="sum")

    def _score(self, probs: Tensor, target: Tensor) -> Tensor:
        raise NotImplementedError

    def update(self, probs: Tensor, target: Tensor) -> None:
        """Accumulate a batch of class probabilities and labels."""
        if self.validate_args:
            check_probabilities(probs, target)
        scores = self._score(probs, target)
        sum_name, count_name = f"{self._state}_sum", f"{self._state}_count"
        setattr(self, sum_name, getattr(self, sum_name) + scores.sum())
        setattr(self, count_name, getattr(self, count_name) + scores.numel())

    def compute(self) -> Tensor:
        """Mean score over all points seen (NaN before any point)."""
        total: Tensor = getattr(self, f"{self._state}_sum")
        count: Tensor = getattr(self, f"{self._state}_count")
        return total / count.to(total)


class ClassificationNLL(_MeanOfClassScores):
    r"""Mean negative log-probability of the true class, :math:`\frac1N\sum_i -\log p_{i,y_i}`.

    Args:
        eps: probabilities are clamped below at ``eps`` so a confident mistake scores
            :math:`-\log\varepsilon` (27.6 by default) instead of infinity.
        validate_args: check inputs on every update.
        kwargs: passed to :class:`torchmetrics.Metric`.

    Examples:
        >>> m = ClassificationNLL()
        >>> m.update(torch.tensor([[0.5, 0.5]]), torch.tensor([0]))
        >>> round(m.compute().item(), 4)
        0.6931
    """

    _state = "class_nll"

    def __init__(self, eps: float = 1e-12, validate_args: bool = True, **kwargs: Any) -> None:
        if not 0.0 < eps < 1.0:
            raise ValueError(f"eps must lie in (0, 1), got {eps}")
        super().__init__(validate_args=validate_args, **kwargs)
        self.eps = eps

    def _score(self, probs: Tensor, target: Tensor) -> Tensor:
        return categorical_nll(probs, target, self.eps)


class BrierScore(_MeanOfClassScores):
    r"""Mean multi-class Brier score :math:`\frac1N\sum_i\sum_k (p_{ik} - [y_i = k])^2`.

    Summed over classes (range ``[0, 2]``), not averaged; lower is better.
    """

    _state = "brier"

    def _score(self, probs: Tensor, target: Tensor) -> Tensor:
        return categorical_brier(probs, target)


class ExpectedCalibrationError(MulticlassCalibrationError):
    """torchmetrics' top-label L1 calibration error, plus its reliability-diagram bins.

    Args:
        num_classes: number of classes ``K``.
        n_bins: confidence bins.
        **kwargs: passed to ``MulticlassCalibrationError``.
    """

    def __init__(self, num_classes: int, n_bins: int = 15, **kwargs: Any) -> None:
        super().__init__(num_classes, n_bins=n_bins, norm="l1", **kwargs)

    def reliability_bins(self) -> dict[str, Tensor]:
        """:func:`~lightning_dvi.metrics.functional.reliability_bins` of every update so far.

        Synchronised across processes (as ``compute()`` is, when ``sync_on_compute``).
        """
        with self.sync_context(should_sync=self.sync_on_compute):
            confidence = dim_zero_cat(self.confidences)
            accuracy = dim_zero_cat(self.accuracies)
        return reliability_bins(confidence, accuracy, self.n_bins)


class ClassificationMetrics(MetricCollection):
    """Accuracy, NLL, Brier score and ECE in one collection, updated with ``(probs, target)``.

    ``compute()`` returns scalar tensors keyed (after ``prefix``) ``acc``, ``nll``, ``brier`` and
    ``ece``. Every member returns a tensor, so the collection can also be passed to
    ``LightningModule.log_dict`` as an object.

    Args:
        num_classes: number of classes ``K``.
        prefix: prepended to every key, e.g. ``"val/"``.
        n_bins: confidence bins of the (top-label, L1) expected calibration error.
        validate_args: check inputs on every update (once, here, not in each member).

    Examples:
        >>> metrics = ClassificationMetrics(3)
        >>> metrics.update(torch.tensor([[0.7, 0.2, 0.1]]), torch.tensor([0]))
        >>> sorted(metrics.compute())
        ['acc', 'brier', 'ece', 'nll']
    """

    def __init__(
        self, num_classes: int, prefix: str = "", n_bins: int = 15, validate_args: bool = True
    ) -> None:
        if num_classes < 2:
            raise ValueError(f"num_classes must be at least 2, got {num_classes}")
        super().__init__(
            {
                "acc": MulticlassAccuracy(num_classes, average="micro", validate_args=False),
                "nll": ClassificationNLL(validate_args=False),
                "brier": BrierScore(validate_args=False),
                "ece": ExpectedCalibrationError(num_classes, n_bins=n_bins, validate_args=False),
            },
            prefix=prefix or None,
            compute_groups=False,
        )
        self.num_classes = num_classes
        self.validate_args = validate_args

    def _prepare(self, probs: Tensor, target: Tensor) -> Tensor:
        if self.validate_args:
            check_probabilities(probs, target)
            if probs.shape[1] != self.num_classes:
                raise ValueError(
                    f"probs has {probs.shape[1]} classes, the metrics expect {self.num_classes}"
                )
        # torchmetrics' calibration error applies a softmax to any input outside [0, 1]; the
        # tolerance the check allows must not trigger that.
        return probs.clamp(0.0, 1.0)

    def update(self, probs: Tensor, target: Tensor) -> None:  # type: ignore[override]  # MetricCollection.update takes *args, **kwargs
        """Validate once, then update every member."""
        super().update(self._prepare(probs, target), target)

    def forward(self, probs: Tensor, target: Tensor) -> dict[str, Any]:
        """Validate, update every member, and return this batch's values."""
        return super().forward(self._prepare(probs, target), target)


def classification_metrics(
    num_classes: int, prefix: str = "", **kwargs: Any
) -> ClassificationMetrics:
    """Deprecated shorthand for :class:`ClassificationMetrics`; removed in the next release."""
    warnings.warn(
        "lightning_dvi.metrics.classification_metrics() is deprecated and will be removed in the next release; "
        "use ClassificationMetrics(...)",
        DeprecationWarning,
        stacklevel=2,
    )
    return ClassificationMetrics(num_classes, prefix=prefix, **kwargs)
