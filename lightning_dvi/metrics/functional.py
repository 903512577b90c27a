r"""Per-point scoring rules and input checks: the functional core under the metric classes.

Every function here is elementwise (one value per data point, no reduction), so the
:class:`~torchmetrics.Metric` classes only add sums and counts, and DDP sync stays a cheap
``all_reduce`` of a few scalars.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..likelihoods.functional import normal_expected_log_prob

__all__ = [
    "categorical_brier",
    "categorical_nll",
    "central_interval_hits",
    "central_interval_hits_from_pit",
    "check_gaussian_inputs",
    "check_probabilities",
    "ece_noise_floor",
    "gaussian_crps",
    "gaussian_nll",
    "level_name",
    "reliability_bins",
]

_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)
_INV_SQRT_2 = 1.0 / math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def check_gaussian_inputs(mean: Tensor, var: Tensor, target: Tensor) -> None:
    """Raise ``ValueError`` unless ``(mean, var, target)`` is a valid Gaussian predictive batch.

    Args:
        mean: predictive means.
        var: predictive variances, same shape, non-negative.
        target: observed targets, same shape.

    Raises:
        ValueError: naming the problem: shape mismatch, a non-floating dtype, NaN or infinite
            entries, or negative variances.
    """
    if not (mean.shape == var.shape == target.shape):
        raise ValueError(
            "mean, var and target must have the same shape, got "
            f"{tuple(mean.shape)}, {tuple(var.shape)} and {tuple(target.shape)}"
        )
    for name, tensor in (("mean", mean), ("var", var), ("target", target)):
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got dtype {tensor.dtype}")
        if torch.isnan(tensor).any():
            raise ValueError(f"{name} contains NaN")
        if torch.isinf(tensor).any():
            raise ValueError(f"{name} contains infinite values")
    if (var < 0).any():
        raise ValueError(f"var must be non-negative, got a minimum of {var.min().item():.6g}")


def check_probabilities(probs: Tensor, target: Tensor, atol: float | None = None) -> None:
    """Raise ``ValueError`` unless ``probs [B, K]`` and ``target [B]`` are a valid class batch.

    Args:
        probs: class probabilities, rows in ``[0, 1]`` summing to one.
        target: integer class labels in ``[0, K)``.
        atol: tolerance on the row sums and the ``[0, 1]`` range; by default
            ``max(1e-3, 4 * eps(dtype))`` so float32 softmax passes and so do half precisions.

    Raises:
        ValueError: naming the problem: wrong rank or dtype, batch-size mismatch, NaN, values
            outside ``[0, 1]``, rows not summing to one, or labels out of range.
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape [B, K], got {tuple(probs.shape)}")
    if target.ndim != 1:
        raise ValueError(f"target must have shape [B], got {tuple(target.shape)}")
    if probs.shape[0] != target.shape[0]:
        raise ValueError(
            f"probs and target disagree on the batch size: {probs.shape[0]} vs {target.shape[0]}"
        )
    if not probs.is_floating_point():
        raise ValueError(f"probs must be a floating-point tensor, got dtype {probs.dtype}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise ValueError(f"target must hold integer class labels, got dtype {target.dtype}")
    if torch.isnan(probs).any():
        raise ValueError("probs contains NaN")
    if atol is None:
        atol = max(1e-3, 4.0 * torch.finfo(probs.dtype).eps)
    if ((probs < -atol) | (probs > 1.0 + atol)).any():
        raise ValueError(
            f"probs must lie in [0, 1], got values in [{probs.min().item():.6g}, "
            f"{probs.max().item():.6g}]"
        )
    # Sum in at least float32 so half-precision rows are not judged by their own rounding.
    row_error = (probs.to(torch.promote_types(probs.dtype, torch.float32)).sum(-1) - 1.0).abs()
    if (row_error > atol).any():
        raise ValueError(
            f"probs rows must sum to 1 (tolerance {atol:g}); the worst row is off by "
            f"{row_error.max().item():.6g}"
        )
    num_classes = probs.shape[1]
    if target.numel() and (target.min() < 0 or target.max() >= num_classes):
        raise ValueError(
            f"target labels must lie in [0, {num_classes}), got values in "
            f"[{target.min().item()}, {target.max().item()}]"
        )


def gaussian_nll(mean: Tensor, var: Tensor, target: Tensor) -> Tensor:
    r"""Negative log-density :math:`\tfrac12\log(2\pi\sigma^2) + (y-\mu)^2 / (2\sigma^2)`.

    Zero variances are floored at the dtype's smallest normal number, so a degenerate
    predictive scores a huge finite value instead of NaN.
    """
    var = var.clamp_min(torch.finfo(var.dtype).tiny)
    return -normal_expected_log_prob(mean, torch.zeros_like(var), target, var)


def gaussian_crps(mean: Tensor, var: Tensor, target: Tensor) -> Tensor:
    r"""Closed-form CRPS of :math:`\mathcal N(\mu, \sigma^2)` at :math:`y` (lower is better).

    .. math::
        \mathrm{CRPS} = \sigma\left[z\,(2\Phi(z) - 1) + 2\varphi(z) - \tfrac{1}{\sqrt\pi}\right],
        \qquad z = \frac{y - \mu}{\sigma},

    with the limit :math:`|y - \mu|` (the absolute error) at :math:`\sigma = 0`.
    """
    residual = target - mean
    std = var.sqrt()
    degenerate = std == 0
    # A placeholder scale of 1 keeps z finite where sigma = 0; those entries are replaced below.
    safe_std = torch.where(degenerate, torch.ones_like(std), std)
    z = residual / safe_std
    # erf(z / sqrt 2) = 2 Phi(z) - 1, without the cancellation of 2 * ndtr(z) - 1 near z = 0.
    score = safe_std * (
        z * torch.erf(z * _INV_SQRT_2)
        + 2.0 * _INV_SQRT_2PI * torch.exp(-0.5 * z * z)
        - _INV_SQRT_PI
    )
    return torch.where(degenerate, residual.abs(), score)


def central_interval_hits(mean: Tensor, var: Tensor, target: Tensor, levels: Tensor) -> Tensor:
    r"""Whether each target lies in each central predictive interval (bounds included).

    The central interval of level :math:`p` is :math:`\mu \pm \sigma\,\Phi^{-1}(\tfrac12 +
    \tfrac p2)`: level 0 is the point :math:`\mu`, level 1 the whole line.

    Args:
        mean: predictive means, shape ``[B]`` (any shape is flattened).
        var: predictive variances, same shape.
        target: targets, same shape.
        levels: interval levels in ``[0, 1]``, shape ``[L]`` (best kept on the CPU).

    Returns:
        Boolean tensor ``[B, L]``.
    """
    residual = (target - mean).reshape(-1, 1).abs()
    std = var.reshape(-1, 1).sqrt()
    # Quantiles in float64 on the CPU (exact levels; some accelerators lack float64), then cast.
    half_width = torch.special.ndtri(0.5 + 0.5 * levels.detach().cpu().double())
    half_width = half_width.to(device=std.device, dtype=std.dtype).reshape(1, -1)
    # inf * 0 is NaN: at level 1 every target is inside, whatever the variance.
    bound = torch.where(torch.isposinf(half_width), half_width, half_width * std)
    return residual <= bound


def central_interval_hits_from_pit(pit: Tensor, levels: Tensor) -> Tensor:
    r"""Whether each target lies in each central interval, from its PIT :math:`u = F(y)`.

    For a continuous predictive with CDF :math:`F`, :math:`y` lies in the central interval of
    level :math:`p`, :math:`[F^{-1}(\tfrac12 - \tfrac p2), F^{-1}(\tfrac12 + \tfrac p2)]`,
    exactly when :math:`|2u - 1| \le p`. For a Gaussian this is :func:`central_interval_hits`;
    for any other predictive (e.g. the heteroscedastic scale mixture,
    :class:`~lightning_dvi.likelihoods.HeteroscedasticPredictive`) it needs only the CDF.

    Args:
        pit: :math:`F(y)` per target, in ``[0, 1]``, shape ``[B]`` (any shape is flattened).
        levels: interval levels in ``[0, 1]``, shape ``[L]``.

    Returns:
        Boolean tensor ``[B, L]``.
    """
    distance = (2.0 * pit.reshape(-1, 1).double() - 1.0).abs()
    grid = levels.detach().double().to(distance.device).reshape(1, -1)
    return distance <= grid


def categorical_nll(probs: Tensor, target: Tensor, eps: float = 1e-12) -> Tensor:
    r"""Per-point :math:`-\log p_y`, with :math:`p_y` clamped below at ``eps``."""
    picked = probs.gather(-1, target.long().unsqueeze(-1)).squeeze(-1)
    return -torch.log(picked.clamp_min(eps))


def categorical_brier(probs: Tensor, target: Tensor) -> Tensor:
    r"""Per-point Brier score :math:`\sum_k (p_k - [y = k])^2` (summed over classes, in [0, 2])."""
    one_hot = torch.nn.functional.one_hot(target.long(), probs.shape[-1]).to(probs)
    return ((probs - one_hot) ** 2).sum(dim=-1)


def _confidence_bins(confidence: Tensor, n_bins: int) -> tuple[Tensor, Tensor]:
    """Equal-width bin edges on [0, 1] (float64) and each confidence's bin (1 joins the last)."""
    edges = torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float64, device=confidence.device)
    index = (torch.bucketize(confidence, edges, right=True) - 1).clamp(0, n_bins - 1)
    return edges, index


def reliability_bins(confidence: Tensor, accuracy: Tensor, n_bins: int) -> dict[str, Tensor]:
    r"""Reliability-diagram bins of top-label confidences and hits.

    Bins are :math:`[b/n, (b+1)/n)`, as in torchmetrics' ECE (a confidence of exactly 1 joins
    the last bin). The ECE is :math:`\sum_b \frac{n_b}{N}|\bar a_b - \bar c_b|` over them.

    Args:
        confidence: top-label probabilities ``[N]``.
        accuracy: whether the top label was right, ``[N]`` (0/1).
        n_bins: number of equal-width bins on [0, 1].

    Returns:
        ``bin_edges [n_bins + 1]``, ``count``, mean ``confidence`` and mean ``accuracy`` per
        bin (``[n_bins]`` each, float64; empty bins hold 0).
    """
    confidence, accuracy = confidence.double(), accuracy.double()
    edges, index = _confidence_bins(confidence, n_bins)
    count = torch.zeros(n_bins, dtype=torch.float64, device=confidence.device)
    count.index_add_(0, index, torch.ones_like(confidence))
    conf_sum = torch.zeros_like(count).index_add_(0, index, confidence)
    acc_sum = torch.zeros_like(count).index_add_(0, index, accuracy)
    safe = count.clamp_min(1)
    return {
        "bin_edges": edges,
        "count": count,
        "confidence": conf_sum / safe,
        "accuracy": acc_sum / safe,
    }


def ece_noise_floor(probs: Tensor, n_bins: int = 15, draws: int = 200, seed: int = 0) -> float:
    r"""The expected top-label ECE of a *perfectly calibrated* model with these predictions.

    A finite test set gives even a calibrated predictor a positive ECE: the hits in a bin
    scatter around the bin's mean confidence. This draws the labels from the predictions
    themselves, so that each top-label hit is Bernoulli with probability the top-label
    confidence :math:`c_n` (the calibrated world), and averages the binned ECE
    :math:`\sum_b \frac1N\bigl|\sum_{n\in b}(h_n - c_n)\bigr|` over ``draws`` draws, with the
    bins of :func:`reliability_bins` (torchmetrics' ECE). An observed ECE at or below this
    value is indistinguishable from perfect calibration on this many rows; two models' ECEs
    are comparable only where they stand above their floors by more than its spread. On the
    360 test digits of the classification benchmark the floor is 0.015-0.021; on 1797 rows
    (all digits, ``lightning_dvi_benchmarks.data.digits_folds`` in benchmarks/) 0.007-0.011.

    Args:
        probs: predictive class probabilities ``[N, K]``.
        n_bins: equal-width confidence bins.
        draws: Monte Carlo draws of the labels.
        seed: seeds the draws.

    Returns:
        The mean ECE over the draws.

    Raises:
        ValueError: for an empty or non-2-D ``probs``, a NaN or a value outside [0, 1], or
            ``draws < 1``.

    Examples:
        >>> ece_noise_floor(torch.eye(3))  # certain and calibrated: no scatter
        0.0
    """
    if probs.dim() != 2 or probs.shape[0] == 0 or draws < 1:
        raise ValueError(
            f"ece_noise_floor needs probs [N, K] with N > 0 and draws >= 1, got "
            f"{tuple(probs.shape)} and draws={draws}"
        )
    confidence = probs.detach().double().max(-1).values
    if not bool(((confidence >= 0) & (confidence <= 1)).all()):
        raise ValueError("ece_noise_floor needs probabilities in [0, 1] (got NaN or out of range)")
    n = confidence.shape[0]
    _, index = _confidence_bins(confidence, n_bins)
    gen = torch.Generator(device=confidence.device).manual_seed(seed)
    uniform = torch.rand(draws, n, generator=gen, dtype=torch.float64, device=confidence.device)
    gap = (uniform < confidence).double() - confidence  # hit minus confidence, per draw and row
    per_bin = torch.zeros(draws, n_bins, dtype=torch.float64, device=confidence.device)
    per_bin.index_add_(1, index, gap)
    return float(per_bin.abs().sum(-1).mean() / n)


def level_name(level: float) -> str:
    """Log name of an interval level: ``0.9 -> "coverage_90"``, ``0.975 -> "coverage_97.5"``."""
    return f"coverage_{100.0 * level:g}"
