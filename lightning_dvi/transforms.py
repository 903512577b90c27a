r"""Target units: one outcome transform, fitted once from the training targets.

A regression network is trained on standardised targets :math:`\tilde y = (y - m) / s` and
reports its predictive in the targets' original units. :class:`Standardize` owns that map (the
location :math:`m`, the scale :math:`s`, whether batches already hold :math:`\tilde y`, and the
grid step the targets are recorded on); the regressor trains through :meth:`Standardize.forward`
and reports through :meth:`Standardize.untransform` and
:meth:`Standardize.untransform_log_prob`, and :func:`~lightning_dvi.nn.export_predictive` reads
the same object. Its state is two float64 buffers, so a checkpoint carries it as plain tensors
(``torch.load(weights_only=True)``).

:func:`location_scale` is the one fitting function: the data modules standardise their features
and targets with it, and :meth:`Standardize.fit` calls it on the training targets.

:class:`TargetStatistics` is what a regressor reads from a datamodule about its targets.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor, nn

__all__ = ["Standardize", "TargetStatistics", "location_scale", "target_grid_step"]


def location_scale(values: Tensor) -> tuple[Tensor, Tensor]:
    r"""Means and standard deviations (``ddof=0``) of ``values`` along dimension 0, in float64.

    :math:`m = \frac1N\sum_i v_i`, :math:`s = \sqrt{\frac1N\sum_i (v_i - m)^2}`, per column of
    ``values [N, ...]`` (a ``[N]`` tensor gives 0-dimensional results). A constant column (``s``
    at round-off level against :math:`\max(1, |m|)`) gets scale 1, so it standardises to zero
    instead of dividing by ~0. A column whose sums overflow float64 (values near 1e300) is summed
    in units of its largest magnitude instead. NaN propagates.

    Examples:
        >>> loc, scale = location_scale(torch.tensor([[1.0, 5.0], [3.0, 5.0]]))
        >>> loc.tolist(), scale.tolist()
        ([2.0, 5.0], [1.0, 1.0])
    """
    values = values.detach().to(torch.float64)
    loc, scale = values.mean(dim=0), values.std(dim=0, correction=0)
    overflow = ~(torch.isfinite(loc) & torch.isfinite(scale)) & torch.isfinite(values).all(dim=0)
    if bool(overflow.any()):
        size = values.abs().amax(dim=0)
        unit = values / torch.where(overflow, size, torch.ones_like(size))
        loc = torch.where(overflow, size * unit.mean(dim=0), loc)
        scale = torch.where(overflow, size * unit.std(dim=0, correction=0), scale)
    constant = scale <= 1e-12 * loc.abs().clamp_min(1.0)
    return loc, torch.where(constant, torch.ones_like(scale), scale)


def target_grid_step(y: Tensor) -> float:
    r"""The largest decimal step :math:`\Delta = 10^k` that every target is a multiple of.

    "Recorded with so many decimals": integer scores give 1, prices in cents 0.01. A target
    counts as a multiple when it is within :math:`10^{-3}\Delta` of one, so values that went
    through float32 still count. :math:`-6 \le k \le 6`, and :math:`\Delta` is at most the
    targets' range (every target is near a multiple of a much larger step: 0). Fewer than two
    distinct targets, or none of the steps, give 0 (continuous).

    Examples:
        >>> target_grid_step(torch.tensor([3.0, 5.0, 6.0]))
        1.0
        >>> target_grid_step(torch.tensor([21.6, 34.7, 50.0]))
        0.1
        >>> target_grid_step(torch.tensor([0.1234567, 0.5]))
        0.0
    """
    y = y.detach().reshape(-1).to(torch.float64)
    if y.numel() < 2 or not bool(torch.isfinite(y).all()):
        return 0.0
    spread = float(y.max() - y.min())
    if spread == 0:
        return 0.0
    # a step above the spread would count every target as a multiple of it (all near 0)
    largest = min(6, math.floor(math.log10(spread) + 1e-9))
    for k in range(largest, -7, -1):
        step = 10.0**k
        ratio = y / step
        if float((ratio - ratio.round()).abs().max()) <= 1e-3:
            return step
    return 0.0


def checked_resolution(value: float | str | None) -> float | str | None:
    """``None``, ``"auto"`` or a finite step >= 0 (as a float).

    Raises:
        ValueError: for anything else.
    """
    if value is None or value == "auto":
        return value
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not (math.isfinite(value) and value >= 0)
    ):
        raise ValueError(
            f"target_resolution must be None, 'auto' or a finite number >= 0 (the targets' grid "
            f"step in their original units), got {value!r}"
        )
    return float(value)


def checked_statistics(loc: float | None, scale: float | None) -> tuple[float, float]:
    r"""``(m, s)``: ``loc`` finite (default 0), ``scale`` finite > 0 (default 1).

    Raises:
        ValueError: for a non-finite ``loc`` or a ``scale`` not in :math:`(0, \infty)`.
    """
    loc_value = 0.0 if loc is None else float(loc)
    scale_value = 1.0 if scale is None else float(scale)
    if not (math.isfinite(loc_value) and 0.0 < scale_value < math.inf):
        raise ValueError(
            f"target_loc must be finite and target_scale finite and > 0, got {loc!r}, {scale!r}"
        )
    return loc_value, scale_value


class Standardize(nn.Module):
    r"""The affine map between a regression target's original units and the network's.

    :math:`\tilde y = (y - m) / s` (:meth:`transform`) and back, :math:`\mu = \tilde\mu s + m`,
    :math:`\sigma^2 = \tilde\sigma^2 s^2` (:meth:`untransform`); a density changes by the
    Jacobian, :math:`\log p(y) = \log \tilde p(\tilde y) - \log s`
    (:meth:`untransform_log_prob`). Everything is computed in float64: a target near
    :math:`10^8` is a multiple of 8 in float32, so a float32 inverse would round the signal away.

    Batches hold targets either in their original units (``batches_standardized=False``, the
    default: :meth:`forward` standardises them) or already standardised (``True``: :meth:`forward`
    passes them through and :math:`(m, s)` only map predictions back).

    The grid step :math:`\Delta` of the targets (1 for integer scores, 0.01 for cents) is kept
    in original units as ``resolution``: ``None`` or a float (0: continuous), or ``"auto"`` until
    :meth:`fit_resolution` reads it from the training targets; the likelihood sees
    :math:`\Delta / s` (:meth:`network_resolution`).

    State: the float64 buffers ``loc`` and ``scale`` (persistent); ``batches_standardized`` and
    ``resolution`` are constructor arguments (a model records them as hyper-parameters).

    Args:
        loc: :math:`m`; ``None``: 0 until :meth:`fit`.
        scale: :math:`s > 0`; ``None``: 1 until :meth:`fit`.
        batches_standardized: whether batches hold :math:`\tilde y` already.
        resolution: the targets' grid step in original units, ``"auto"`` or ``None``.

    Raises:
        ValueError: for a non-finite ``loc``, a ``scale`` not in :math:`(0,\infty)` or a bad
            ``resolution``.

    Examples:
        >>> t = Standardize().fit(torch.tensor([1.0, 2.0, 3.0]))
        >>> t.transform(torch.tensor([2.0])).tolist()
        [0.0]
        >>> mean, var = t.untransform(torch.tensor([1.0]), torch.tensor([1.0]))
        >>> round(float(mean), 4), round(float(var), 4)
        (2.8165, 0.6667)
    """

    loc: Tensor  # buffers
    scale: Tensor

    def __init__(
        self,
        loc: float | None = None,
        scale: float | None = None,
        *,
        batches_standardized: bool = False,
        resolution: float | str | None = None,
    ) -> None:
        super().__init__()
        loc_value, scale_value = checked_statistics(loc, scale)
        self.register_buffer("loc", torch.tensor(loc_value, dtype=torch.float64))
        self.register_buffer("scale", torch.tensor(scale_value, dtype=torch.float64))
        self.batches_standardized = bool(batches_standardized)
        self.resolution = checked_resolution(resolution)

    # ------------------------------------------------------------------ fitting
    def set_statistics(self, loc: float | None, scale: float | None) -> tuple[float, float]:
        """Set :math:`(m, s)` (checked; ``None``: 0 and 1) and return them as floats."""
        loc_value, scale_value = checked_statistics(loc, scale)
        self.loc.fill_(loc_value)
        self.scale.fill_(scale_value)
        return loc_value, scale_value

    def fit(self, y: Tensor) -> Standardize:
        """Set :math:`(m, s)` to the mean and ``ddof=0`` std of the training targets ``y`` [N].

        Raises:
            ValueError: for no targets, NaN/Inf targets, or more than one number per example.
        """
        if y.dim() > 1 and y[0].numel() != 1:
            raise ValueError(
                "regression targets must be one number per example, got targets of shape "
                f"{tuple(y.shape)}"
            )
        y = y.detach().reshape(-1).to(torch.float64)
        if y.numel() == 0:
            raise ValueError("cannot compute target statistics from an empty training set")
        if not bool(torch.isfinite(y).all()):
            raise ValueError("the training targets contain NaN or Inf")
        loc, scale = location_scale(y)
        self.set_statistics(float(loc), float(scale))
        return self

    def fit_resolution(self, y: Tensor) -> float:
        """Resolve ``resolution="auto"`` from training targets ``y`` in original units."""
        self.resolution = target_grid_step(y)
        return self.resolution

    def network_resolution(self) -> float:
        r"""The grid step as the network sees it, :math:`\Delta / s` (0 without one)."""
        step = self.resolution
        return step / float(self.scale) if isinstance(step, float) else 0.0

    # ------------------------------------------------------------------ to network units
    def transform(self, y: Tensor) -> Tensor:
        r""":math:`(y - m) / s` for ``y`` in original units, float64."""
        return (y.to(torch.float64) - self.loc) / self.scale

    def forward(self, y: Tensor, dtype: torch.dtype | None = None) -> Tensor:
        """Batch targets in network units: standardised in float64 (unless they already are), then cast.

        Raises:
            ValueError: for a finite target that ``dtype`` cannot hold afterwards.
        """
        standardized = y.to(torch.float64)
        if not self.batches_standardized:
            standardized = (standardized - self.loc) / self.scale
        if dtype is None:
            return standardized
        out = standardized.to(dtype)
        if not bool(torch.isfinite(out).all()) and bool(torch.isfinite(standardized).all()):
            i = int((~torch.isfinite(out)).reshape(-1).nonzero()[0])
            raise ValueError(
                f"the target {float(y.reshape(-1)[i]):.6g} is "
                f"{float(standardized.reshape(-1)[i]):.6g} after standardising (target_loc="
                f"{float(self.loc):.6g}, target_scale={float(self.scale):.6g}), "
                f"which does not fit in {dtype} (largest {torch.finfo(dtype).max:.6g}); check "
                "target_loc/target_scale, or rescale the targets"
            )
        return out

    def original_targets(self, y: Tensor) -> Tensor:
        """Batch targets in original units, float64 (undoes a pre-standardisation if any)."""
        y = y.to(torch.float64)
        return y * self.scale + self.loc if self.batches_standardized else y

    # ------------------------------------------------------------------ back to original units
    def untransform(self, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
        r"""Predictive moments in original units, :math:`(\tilde\mu s + m, \tilde\sigma^2 s^2)`, float64."""
        loc, scale = self.loc.to(torch.float64), self.scale.to(torch.float64)
        return mean.to(torch.float64) * scale + loc, self.untransform_variance(var)

    def untransform_variance(self, var: Tensor) -> Tensor:
        r""":math:`\tilde\sigma^2 s^2` in float64."""
        return var.to(torch.float64) * self.scale.to(torch.float64).square()

    def untransform_log_prob(self, log_prob: Tensor) -> Tensor:
        r"""A log-density of :math:`\tilde y` as one of :math:`y`: :math:`\log\tilde p - \log s`."""
        return log_prob.to(torch.float64) - torch.log(self.scale)

    def extra_repr(self) -> str:
        """``loc``, ``scale`` and the batches' units."""
        return (
            f"loc={float(self.loc):.6g}, scale={float(self.scale):.6g}, "
            f"batches_standardized={self.batches_standardized}, resolution={self.resolution!r}"
        )


@runtime_checkable
class TargetStatistics(Protocol):
    """What a regressor reads from a datamodule about its targets.

    A datamodule that has fitted the target standardisation on its training split declares it
    with these three members (the built-in regression data modules do);
    :class:`~lightning_dvi.DVIRegressor` and the CLI read them through this protocol. A
    datamodule without any of them leaves the regressor to fit the statistics on the training
    targets; one with only some of them is an error.

    Attributes:
        target_loc: the training targets' mean, original units.
        target_scale: their standard deviation (``ddof=0``), > 0.
        targets_standardized: whether the batches hold standardised targets.
    """

    @property
    def target_loc(self) -> float:
        """The training targets' mean."""
        ...

    @property
    def target_scale(self) -> float:
        """The training targets' standard deviation."""
        ...

    @property
    def targets_standardized(self) -> bool:
        """Whether batches hold ``(y - target_loc) / target_scale``."""
        ...


TARGET_STATISTICS = ("target_loc", "target_scale", "targets_standardized")


def target_statistics_of(datamodule: object, who: str) -> TargetStatistics | None:
    """``datamodule`` as a :class:`TargetStatistics`, or ``None`` when it has none of its members.

    Raises:
        ValueError: for a datamodule that has some of the members but not all.
    """
    if datamodule is None:
        return None
    if isinstance(datamodule, TargetStatistics):
        return datamodule
    present = [name for name in TARGET_STATISTICS if hasattr(datamodule, name)]
    # a data module of other targets may say its targets are not standardised (InMemoryDataModule)
    says_standardized = bool(getattr(datamodule, "targets_standardized", False))
    flag_only = present == ["targets_standardized"] and not says_standardized
    if present and not flag_only:
        missing = [name for name in TARGET_STATISTICS if name not in present]
        raise ValueError(
            f"{who}: the datamodule {type(datamodule).__name__} has {', '.join(present)} but not "
            f"{', '.join(missing)}; a datamodule that fits the target standardisation declares "
            "all of lightning_dvi.transforms.TargetStatistics (target_loc, target_scale, "
            "targets_standardized)"
        )
    return None
