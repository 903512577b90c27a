r"""Calibration metrics for Gaussian regression predictives, as torchmetrics ``Metric`` classes.

Every metric here is updated with ``update(mean, var, target)``: the predictive mean and variance
of :math:`y` and the observed targets, all tensors of the same shape (usually ``[B]``) and all in
whatever units the caller passes. Models trained on standardised targets convert back to the
original units first, as the literature reports them: ``mean * s + m``, ``var * s**2``.

States are sums and counts (``dist_reduce_fx="sum"``), so DDP sync is an ``all_reduce`` of a few
numbers. States use torch's default dtype, as in torchmetrics; call ``metric.set_dtype(torch.float64)``
to accumulate in double precision.

Definitions follow uncertainty-toolbox (Chung et al., 2021): central-interval coverage, mean
absolute and root-mean-square calibration error over a grid of levels, sharpness as the root mean
predictive variance.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import MeanSquaredError, Metric, MetricCollection

from .functional import (
    central_interval_hits,
    central_interval_hits_from_pit,
    check_gaussian_inputs,
    gaussian_crps,
    gaussian_nll,
    level_name,
)

__all__ = [
    "REGRESSION_METRIC_NAMES",
    "RMSE",
    "GaussianCRPS",
    "GaussianNLL",
    "IntervalCoverage",
    "RegressionCalibrationError",
    "RegressionMetrics",
    "Sharpness",
    "regression_metric_selection",
    "regression_metrics",
]

REGRESSION_METRIC_NAMES = ("nll", "rmse", "crps", "coverage", "calibration", "sharpness")
"""The members of :class:`RegressionMetrics`, in its order."""


def regression_metric_selection(
    argument: str, names: Sequence[str] | None, extra: Sequence[str] = ()
) -> tuple[str, ...]:
    """``names`` checked against :data:`REGRESSION_METRIC_NAMES` (and ``extra``); ``None``: all.

    Raises:
        ValueError: naming ``argument``, for a bare string, an empty selection or an unknown
            name (the message lists the choices).
    """
    choices = (*REGRESSION_METRIC_NAMES, *extra)
    if names is None:
        return choices
    if isinstance(names, str) or not names:
        raise ValueError(
            f"{argument} must be a non-empty list of names from {', '.join(choices)} (or None "
            f"for all), got {names!r}"
        )
    unknown = [name for name in names if name not in choices]
    if unknown:
        raise ValueError(
            f"{argument}: unknown metric {unknown[0]!r}; choose from {', '.join(choices)}"
        )
    return tuple(name for name in choices if name in names)


class _GaussianMetric(Metric):
    """Base for metrics updated with ``(mean, var, target)``; owns the input validation."""

    full_state_update = False

    def __init__(self, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validate_args = validate_args

    def _check(self, mean: Tensor, var: Tensor, target: Tensor) -> None:
        if self.validate_args:
            check_gaussian_inputs(mean, var, target)


class _MeanOfScores(_GaussianMetric):
    """Mean over points of a per-point score; subclasses set ``_score`` and ``_state``."""

    _state: str

    def __init__(self, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(validate_args=validate_args, **kwargs)
        # Distinct state names per metric: MetricCollection's compute groups merge metrics
        # whose states share names and values, which must never happen between two scores.
        self.add_state(f"{self._state}_sum", torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state(f"{self._state}_count", torch.tensor(0), dist_reduce_fx="sum")

    @staticmethod
    def _score(mean: Tensor, var: Tensor, target: Tensor) -> Tensor:
        raise NotImplementedError

    def update(self, mean: Tensor, var: Tensor, target: Tensor) -> None:
        """Accumulate a batch of predictives and targets."""
        self._check(mean, var, target)
        self._accumulate(self._score(mean, var, target))

    def _accumulate(self, scores: Tensor) -> None:
        """Add a batch's per-point scores to the running sum and count."""
        setattr(self, f"{self._state}_sum", getattr(self, f"{self._state}_sum") + scores.sum())
        setattr(
            self, f"{self._state}_count", getattr(self, f"{self._state}_count") + scores.numel()
        )

    def compute(self) -> Tensor:
        """Mean score over all points seen (NaN before any point)."""
        total: Tensor = getattr(self, f"{self._state}_sum")
        count: Tensor = getattr(self, f"{self._state}_count")
        return total / count.to(total)


class GaussianNLL(_MeanOfScores):
    r"""Mean negative log predictive density, :math:`\frac1N\sum_i -\log\mathcal N(y_i; \mu_i, \sigma_i^2)`.

    Lower is better. Zero variances are floored at the dtype's smallest normal number. A
    predictive that is not Gaussian passes its per-point log density to :meth:`update`
    (``log_prob``); the mean and variance are then only validated.

    Examples:
        >>> m = GaussianNLL()
        >>> m.update(torch.zeros(3), torch.ones(3), torch.zeros(3))
        >>> round(m.compute().item(), 4)
        0.9189
    """

    is_differentiable = True
    higher_is_better = False
    _state = "nll"
    _score = staticmethod(gaussian_nll)

    def update(
        self, mean: Tensor, var: Tensor, target: Tensor, log_prob: Tensor | None = None
    ) -> None:
        r"""Accumulate a batch; ``log_prob`` (per point) scores a predictive that is not Gaussian.

        With ``log_prob`` the score is :math:`-\log p(y_i)` as given (e.g. a heteroscedastic
        model's exact predictive, :class:`~lightning_dvi.likelihoods.HeteroscedasticPredictive`,
        whose mean and variance are ``mean`` and ``var`` but whose tails are heavier); without,
        the Gaussian with ``mean`` and ``var``.
        """
        if log_prob is None:
            super().update(mean, var, target)
            return
        self._check(mean, var, target)
        if log_prob.shape != target.shape:
            raise ValueError(
                f"GaussianNLL: log_prob has shape {tuple(log_prob.shape)}, the targets "
                f"{tuple(target.shape)}"
            )
        self._accumulate(-log_prob)


class GaussianCRPS(_MeanOfScores):
    r"""Mean closed-form CRPS of the Gaussian predictive (lower is better).

    :math:`\sigma[z(2\Phi(z) - 1) + 2\varphi(z) - 1/\sqrt\pi]` with :math:`z = (y - \mu)/\sigma`;
    in the units of :math:`y`, and equal to the absolute error when :math:`\sigma = 0`.
    """

    is_differentiable = True
    higher_is_better = False
    _state = "crps"
    _score = staticmethod(gaussian_crps)


class Sharpness(_MeanOfScores):
    r"""Root mean predictive variance :math:`\sqrt{\frac1N\sum_i\sigma_i^2}` (uncertainty-toolbox).

    In the units of :math:`y`; smaller means sharper, which is only good when calibrated.
    """

    is_differentiable = True
    higher_is_better = None
    _state = "sharpness_var"

    @staticmethod
    def _score(mean: Tensor, var: Tensor, target: Tensor) -> Tensor:
        return var

    def compute(self) -> Tensor:
        """Square root of the mean predictive variance."""
        return super().compute().sqrt()


class RMSE(MeanSquaredError):  # noqa: N818 (the parent name ends in "Error", not an exception)
    """Root mean squared error of the predictive mean: torchmetrics' ``MeanSquaredError``.

    Only the signature changes, to ``update(mean, var, target)`` (``var`` is checked, then
    ignored), so it sits in one collection with the other Gaussian metrics.
    """

    full_state_update = False

    def __init__(self, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(squared=False, **kwargs)
        self.validate_args = validate_args

    def update(self, mean: Tensor, var: Tensor, target: Tensor) -> None:  # type: ignore[override]  # (mean, var, target), not (preds, target)
        """Accumulate squared errors of ``mean`` against ``target``."""
        if self.validate_args:
            check_gaussian_inputs(mean, var, target)
        super().update(mean.reshape(-1), target.reshape(-1))


def _check_levels(levels: Sequence[float]) -> tuple[float, ...]:
    out = tuple(float(level) for level in levels)
    if not out:
        raise ValueError("levels must not be empty")
    for level in out:
        if not 0.0 < level < 1.0:
            raise ValueError(f"interval levels must lie in (0, 1), got {level}")
    # Distinct log names, not just distinct values: 0.9 and 0.9000001 would share a key.
    if len({level_name(level) for level in out}) != len(out):
        raise ValueError(f"interval levels must be distinct, got {out}")
    return out


def _hits(mean: Tensor, var: Tensor, target: Tensor, pit: Tensor | None, levels: Tensor) -> Tensor:
    """Central-interval hits ``[B, L]``: from the Gaussian's moments, or from the PIT when given."""
    if pit is None:
        return central_interval_hits(mean, var, target, levels)
    if pit.shape != target.shape:
        raise ValueError(f"pit has shape {tuple(pit.shape)}, the targets {tuple(target.shape)}")
    return central_interval_hits_from_pit(pit, levels)


class IntervalCoverage(_GaussianMetric):
    r"""Fraction of targets inside the central predictive intervals of the given levels.

    The interval of level :math:`p` is :math:`\mu \pm \sigma\,\Phi^{-1}(\tfrac12 + \tfrac p2)`
    (bounds included), or, for a predictive that is not Gaussian, the central interval of its
    own CDF :math:`F`: pass ``pit`` :math:`= F(y)` to :meth:`update`
    (:func:`~lightning_dvi.metrics.functional.central_interval_hits_from_pit`). A calibrated
    predictive covers a fraction :math:`p`.

    Args:
        levels: interval levels in ``(0, 1)``.
        validate_args: check inputs on every update.
        kwargs: passed to :class:`torchmetrics.Metric`.

    ``compute()`` returns a dict of scalar tensors keyed ``coverage_<100 p>``, e.g.
    ``{"coverage_50": ..., "coverage_90": ..., "coverage_95": ...}`` for the default levels.
    """

    is_differentiable = False
    higher_is_better = None
    coverage_hits: Tensor  # metric states (add_state below)
    coverage_count: Tensor

    def __init__(
        self,
        levels: Sequence[float] = (0.5, 0.9, 0.95),
        validate_args: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(validate_args=validate_args, **kwargs)
        self.levels = _check_levels(levels)
        # A plain attribute, not a buffer: it stays a float64 CPU tensor whatever the device.
        self._level_tensor = torch.tensor(self.levels, dtype=torch.float64)
        self.add_state(
            "coverage_hits", torch.zeros(len(self.levels), dtype=torch.long), dist_reduce_fx="sum"
        )
        self.add_state("coverage_count", torch.tensor(0), dist_reduce_fx="sum")

    def update(self, mean: Tensor, var: Tensor, target: Tensor, pit: Tensor | None = None) -> None:
        """Count the targets inside each interval; ``pit`` (:math:`F(y)`) for a non-Gaussian predictive."""
        self._check(mean, var, target)
        hits = _hits(mean, var, target, pit, self._level_tensor)
        self.coverage_hits = self.coverage_hits + hits.sum(dim=0)
        self.coverage_count = self.coverage_count + hits.shape[0]

    def compute(self) -> dict[str, Tensor]:
        """Observed coverage per level, keyed ``coverage_<100 p>``."""
        # Metric.dtype is torch's default dtype unless set_dtype changed it.
        fractions = self.coverage_hits.to(self.dtype) / self.coverage_count.to(self.dtype)
        return {level_name(level): fractions[i] for i, level in enumerate(self.levels)}


class RegressionCalibrationError(_GaussianMetric):
    r"""Expected vs observed coverage of central intervals over a grid of levels.

    With levels :math:`p_j` = ``linspace(0, 1, num_levels)`` and observed coverages
    :math:`\hat p_j` (as in :class:`IntervalCoverage`), returns uncertainty-toolbox's

    * ``mace``: mean absolute calibration error :math:`\frac1L\sum_j|\hat p_j - p_j|`;
    * ``rmsce``: root-mean-square calibration error :math:`\sqrt{\frac1L\sum_j(\hat p_j - p_j)^2}`.

    Both are 0 for a perfectly calibrated predictive and at most 1; lower is better.

    Args:
        num_levels: number of grid levels, endpoints included (uncertainty-toolbox uses 100).
        validate_args: check inputs on every update.
        kwargs: passed to :class:`torchmetrics.Metric`.
    """

    is_differentiable = False
    higher_is_better = False
    calibration_hits: Tensor  # metric states (add_state below)
    calibration_count: Tensor

    def __init__(self, num_levels: int = 100, validate_args: bool = True, **kwargs: Any) -> None:
        super().__init__(validate_args=validate_args, **kwargs)
        if num_levels < 2:
            raise ValueError(f"num_levels must be at least 2, got {num_levels}")
        self.num_levels = num_levels
        self._level_tensor = torch.linspace(0.0, 1.0, num_levels, dtype=torch.float64)
        self.add_state(
            "calibration_hits", torch.zeros(num_levels, dtype=torch.long), dist_reduce_fx="sum"
        )
        self.add_state("calibration_count", torch.tensor(0), dist_reduce_fx="sum")

    def _grid(self) -> Tensor:
        return self._level_tensor.to(device=self.calibration_hits.device, dtype=self.dtype)

    def update(self, mean: Tensor, var: Tensor, target: Tensor, pit: Tensor | None = None) -> None:
        """Count the targets inside each interval of the grid; ``pit`` as :class:`IntervalCoverage`'s."""
        self._check(mean, var, target)
        hits = _hits(mean, var, target, pit, self._level_tensor)
        self.calibration_hits = self.calibration_hits + hits.sum(dim=0)
        self.calibration_count = self.calibration_count + hits.shape[0]

    def _observed(self) -> Tensor:
        return self.calibration_hits.to(self.dtype) / self.calibration_count.to(self.dtype)

    def curve(self) -> tuple[Tensor, Tensor]:
        """``(expected, observed)`` coverage on the grid, synced like ``compute()``.

        For calibration plots: a calibrated model lies on the diagonal.
        """
        with self.sync_context(should_sync=self._to_sync):
            return self._grid(), self._observed()

    def compute(self) -> dict[str, Tensor]:
        """``{"mace": ..., "rmsce": ...}`` as scalar tensors of the metric's dtype."""
        error = self._observed() - self._grid()
        return {"mace": error.abs().mean(), "rmsce": error.pow(2).mean().sqrt()}


class RegressionMetrics(MetricCollection):
    """All regression metrics in one collection, updated with ``(mean, var, target)``.

    Inputs are validated once per update here (the members skip their own checks).

    ``compute()`` returns a flat dict of scalar tensors, keyed (after ``prefix``) ``nll``,
    ``rmse``, ``crps``, ``coverage_<100 p>`` per coverage level, ``mace``, ``rmsce`` and
    ``sharpness``, ready for ``LightningModule.log_dict``. Two members return dicts, so log the
    computed dict (update in each step; ``log_dict(metrics.compute())`` then ``reset()`` at epoch
    end; ``compute`` syncs across processes) rather than the metric objects themselves.

    Args:
        prefix: prepended to every key, e.g. ``"val/"``.
        coverage_levels: levels of the central intervals whose coverage is reported.
        num_calibration_levels: grid size for ``mace`` and ``rmsce``.
        validate_args: check inputs on every update.
        include: the members to build, from :data:`REGRESSION_METRIC_NAMES` (``"nll"``,
            ``"rmse"``, ``"crps"``, ``"coverage"``, ``"calibration"``, ``"sharpness"``);
            ``None`` (default): all. A validation pass that only feeds early stopping on the
            NLL needs ``["nll"]``, and each member left out saves its update, its ``compute``
            and its logged keys.

    Examples:
        >>> metrics = RegressionMetrics(prefix="test/")
        >>> metrics.update(torch.zeros(4), torch.ones(4), torch.randn(4))
        >>> sorted(metrics.compute())[:3]
        ['test/coverage_50', 'test/coverage_90', 'test/coverage_95']
    """

    def __init__(
        self,
        prefix: str = "",
        coverage_levels: Sequence[float] = (0.5, 0.9, 0.95),
        num_calibration_levels: int = 100,
        validate_args: bool = True,
        include: Sequence[str] | None = None,
    ) -> None:
        names = regression_metric_selection("include", include)
        members: dict[str, Metric] = {
            "nll": GaussianNLL(validate_args=False),
            "rmse": RMSE(validate_args=False),
            "crps": GaussianCRPS(validate_args=False),
            "coverage": IntervalCoverage(coverage_levels, validate_args=False),
            "calibration": RegressionCalibrationError(num_calibration_levels, validate_args=False),
            "sharpness": Sharpness(validate_args=False),
        }
        super().__init__(
            {name: metric for name, metric in members.items() if name in names},
            prefix=prefix or None,
            # Merging states by value after the first batch is unsafe for sums and never saves
            # much here.
            compute_groups=False,
        )
        self.validate_args = validate_args

    def update(  # type: ignore[override]  # MetricCollection.update takes *args, **kwargs
        self,
        mean: Tensor,
        var: Tensor,
        target: Tensor,
        log_prob: Tensor | None = None,
        pit: Tensor | None = None,
    ) -> None:
        """Validate once, then update every member.

        For a predictive that is not Gaussian: ``log_prob`` (per point) goes to ``nll``
        (:class:`GaussianNLL`), ``pit`` (its CDF at the target) to ``coverage`` and
        ``calibration``; ``crps`` and ``sharpness`` stay those of the moments' Gaussian.
        """
        if self.validate_args:
            check_gaussian_inputs(mean, var, target)
        extra = {k: v for k, v in (("log_prob", log_prob), ("pit", pit)) if v is not None}
        super().update(mean, var, target, **extra)

    def forward(self, mean: Tensor, var: Tensor, target: Tensor) -> dict[str, Any]:
        """Validate, update every member, and return this batch's values."""
        if self.validate_args:
            check_gaussian_inputs(mean, var, target)
        return super().forward(mean, var, target)


def regression_metrics(prefix: str = "", **kwargs: Any) -> RegressionMetrics:
    """Deprecated shorthand for :class:`RegressionMetrics`; removed in the next release."""
    warnings.warn(
        "lightning_dvi.metrics.regression_metrics() is deprecated and will be removed in the next release; "
        "use RegressionMetrics(...)",
        DeprecationWarning,
        stacklevel=2,
    )
    return RegressionMetrics(prefix=prefix, **kwargs)
