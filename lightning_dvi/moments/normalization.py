r"""Moments of normalization layers: batch normalization (an affine map per channel).

**Batch normalization** with statistics :math:`(\mu_c, \sigma^2_c)` per channel :math:`c`,

.. math::
    y = \gamma_c\,\frac{a - \mu_c}{\sqrt{\sigma^2_c + \epsilon}} + \beta_c
      = s_c\,a + t_c,\qquad
    s_c = \frac{\gamma_c}{\sqrt{\sigma^2_c + \epsilon}},\quad t_c = \beta_c - s_c\,\mu_c ,

is affine in :math:`a` once the statistics are fixed, so a Gaussian
:math:`a \sim \mathcal N(m, \Sigma)` maps *exactly* to
:math:`y \sim \mathcal N(s \circ m + t,\ \Sigma \circ s s^\top)`: means scaled and shifted,
variances scaled by :math:`s_c^2`, covariances (flat ``[B, D]`` inputs, one channel per unit) by
:math:`s_i s_j`, and a cross-covariance :math:`\operatorname{Cov}(r, a)` by :math:`s` column
by column (:func:`~lightning_dvi.moments.cross_through_activation` with slope :math:`s`).

*Eval mode* takes the running statistics (exact). *Train mode* normalizes each channel by
the statistics of its batch: over the batch and the spatial positions, :math:`n` values
:math:`a_k \sim \mathcal N(m_k, v_k)`, three rules (``batch_rule`` of the modules):

* ``"total"`` (the default of the modules): constant statistics :math:`\mu_c = \bar m`,
  :math:`\sigma^2_c = \frac1n\sum_k (m_k - \bar m)^2 + \frac1n\sum_k v_k` (the expected
  batch variance up to the factor :math:`(n-1)/n` on the second term) in the affine map;
* ``"independent"``: the values are independent Gaussians and the batch-normalized channel is
  exactly layer normalization of the vector :math:`(a_1, \dots, a_n)`, whose moments
  :func:`batch_normalize_diag` takes from :func:`~lightning_dvi.moments.layer_norm.normalize_diag`
  (exact up to quadrature: the fluctuation of the batch statistics from draw to draw included;
  memory 81 times the channel's activations). A full covariance across channels keeps its
  correlations: :math:`\Sigma'_{cc'} = \Sigma_{cc'} r_c r_{c'}` with :math:`r_c` the ratio of
  output to input standard deviation;
* ``"means"``: :math:`\sigma^2_c = \frac1n\sum_k (m_k - \bar m)^2`, the statistic a
  deterministic network with the mean activations would see.

All three equal torch's batch normalization when the variances are zero; the running
statistics follow the ``"total"`` statistics (``"means"``: its own). The measurement that chose
the default is in ``docs/moments.md`` ("Normalization layers"): ``"independent"`` is exact on a
batch of independent Gaussians, but in networks, whose examples share each weight draw, no
per-example rule is, and ``"total"`` had the smaller standard-deviation errors behind a hidden
layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from .layer_norm import normalize_diag
from .special import flush

__all__ = [
    "affine_diag",
    "affine_full",
    "batch_norm_statistics",
    "batch_normalize_diag",
    "normalization_scale_shift",
]

BatchRule = Literal["total", "independent", "means"]
"""How train-mode batch statistics are formed from propagated moments (module docstring)."""


def batch_norm_statistics(
    mean: Tensor, var: Tensor | None, dims: Sequence[int], rule: BatchRule = "total"
) -> tuple[Tensor, Tensor]:
    r"""Batch mean and (biased) batch variance per channel, reduced over ``dims`` (kept).

    Args:
        mean: the propagated means :math:`m`, e.g. ``[B, C, H, W]``.
        var: their variances :math:`v` (same shape), or ``None`` for deterministic inputs.
        dims: the dimensions reduced (batch and spatial: every one but the channel's).
        rule: ``"total"`` (and ``"independent"``, whose running statistics these are) adds the
            mean variance :math:`\bar v` to the variance of the means; ``"means"`` does not
            (see the module docstring).

    Returns:
        ``(mu, sigma2)``, shaped like ``mean`` with size 1 on ``dims``.
    """
    if rule not in ("total", "independent", "means"):
        raise ValueError(
            f"batch statistics rule must be 'total', 'independent' or 'means', got {rule!r}"
        )
    dims = tuple(dims)
    sigma2, mu = torch.var_mean(mean, dim=dims, correction=0, keepdim=True)
    if rule != "means" and var is not None:
        sigma2 = sigma2 + var.mean(dim=dims, keepdim=True)
    return mu, sigma2


def normalization_scale_shift(
    mu: Tensor, sigma2: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float
) -> tuple[Tensor, Tensor]:
    r"""The affine map :math:`y = s\,a + t` of normalization by :math:`(\mu, \sigma^2)`.

    :math:`s = \gamma / \sqrt{\sigma^2 + \epsilon}`, :math:`t = \beta - s\mu` (:math:`\gamma = 1`,
    :math:`\beta = 0` when ``weight``/``bias`` is ``None``); every argument broadcasts.
    """
    scale = torch.rsqrt(sigma2 + eps)
    if weight is not None:
        scale = scale * weight
    shift = -mu * scale
    if bias is not None:
        shift = shift + bias
    return scale, shift


def affine_diag(mean: Tensor, var: Tensor, scale: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    r"""Exact moments of :math:`s\,a + t` elementwise: :math:`(s m + t,\ s^2 v)` (broadcasting)."""
    return scale * mean + shift, flush(scale * scale * var)


def affine_full(mean: Tensor, cov: Tensor, scale: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    r"""Exact moments of :math:`s \circ a + t` for :math:`a \sim \mathcal N(m, \Sigma)` ``[..., D]``.

    :math:`(s \circ m + t,\ \Sigma \circ s s^\top)`; ``scale`` and ``shift`` broadcast to ``mean``.
    """
    scale = scale.expand_as(mean)
    return scale * mean + shift, flush(cov * (scale.unsqueeze(-1) * scale.unsqueeze(-2)))


def batch_normalize_diag(mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    r"""Moments of batch normalization (no affine) of independent Gaussians ``[B, C, *]``.

    Per channel, the :math:`n = B\cdot\prod\text{spatial}` values are normalized together:
    :func:`~lightning_dvi.moments.layer_norm.normalize_diag` over that vector (the
    ``"independent"`` rule of the module docstring).
    """
    perm = (1, 0, *range(2, mean.dim()))
    c = mean.shape[1]
    out_mean, out_var = normalize_diag(
        mean.permute(perm).reshape(c, -1), var.permute(perm).reshape(c, -1), eps
    )
    shape = tuple(mean.permute(perm).shape)
    return out_mean.reshape(shape).permute(perm), out_var.reshape(shape).permute(perm)
