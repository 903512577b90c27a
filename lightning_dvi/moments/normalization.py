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

*Eval mode* takes the running statistics (exact). *Train mode* takes batch statistics of the
propagated Gaussians (:func:`batch_norm_statistics`), over the batch and the spatial
positions of each channel, :math:`n` values :math:`m_k` with variances :math:`v_k`:

* ``rule="total"`` (the default of the modules): :math:`\mu_c = \bar m`,
  :math:`\sigma^2_c = \frac1n\sum_k (m_k - \bar m)^2 + \frac1n\sum_k v_k`, the expected
  (biased) batch variance of a batch of independent draws :math:`a_k \sim \mathcal N(m_k,
  v_k)` up to the factor :math:`(n-1)/n` on the second term: the statistic the sampled network
  sees, on average;
* ``rule="means"``: :math:`\sigma^2_c = \frac1n\sum_k (m_k - \bar m)^2`, the statistic a
  deterministic network with the mean activations would see.

Both equal torch's batch statistics when the variances are zero. The statistics are then
constants of the affine map (their fluctuation from draw to draw is not propagated); the
measurement that chose the default is in ``docs/moments.md`` ("Batch normalization").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from .special import flush

__all__ = [
    "affine_diag",
    "affine_full",
    "batch_norm_statistics",
    "normalization_scale_shift",
]

BatchRule = Literal["total", "means"]
"""How train-mode batch statistics are formed from propagated moments (module docstring)."""


def batch_norm_statistics(
    mean: Tensor, var: Tensor | None, dims: Sequence[int], rule: BatchRule = "total"
) -> tuple[Tensor, Tensor]:
    r"""Batch mean and (biased) batch variance per channel, reduced over ``dims`` (kept).

    Args:
        mean: the propagated means :math:`m`, e.g. ``[B, C, H, W]``.
        var: their variances :math:`v` (same shape), or ``None`` for deterministic inputs.
        dims: the dimensions reduced (batch and spatial: every one but the channel's).
        rule: ``"total"`` adds the mean variance :math:`\bar v` to the variance of the means;
            ``"means"`` does not (see the module docstring).

    Returns:
        ``(mu, sigma2)``, shaped like ``mean`` with size 1 on ``dims``.
    """
    if rule not in ("total", "means"):
        raise ValueError(f"batch statistics rule must be 'total' or 'means', got {rule!r}")
    dims = tuple(dims)
    sigma2, mu = torch.var_mean(mean, dim=dims, correction=0, keepdim=True)
    if rule == "total" and var is not None:
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
