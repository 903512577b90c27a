r"""Special functions for moment propagation, written to stay finite in float32 and float64.

All functions are elementwise and differentiable; ratios with removable singularities at
:math:`\rho = 0` are evaluated through series so that values *and gradients* stay finite there.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "asin_over_x",
    "asin_residual_over_x3",
    "clip_correlation",
    "normal_cdf",
    "normal_pdf",
]

_SQRT_HALF = math.sqrt(0.5)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
# Coefficients of (asin(x) - x) / x^3 = sum_k c_k x^(2k): (2k+2)! / (4^(k+1) ((k+1)!)^2 (2k+3)).
_ASIN_SERIES = tuple(
    math.factorial(2 * n) / (4**n * math.factorial(n) ** 2 * (2 * n + 1)) for n in range(1, 13)
)
# Below this |x| the series (12 terms, truncation error < 1e-16) beats the cancelling direct formula.
_SERIES_CUTOFF = 0.25


def normal_cdf(x: Tensor) -> Tensor:
    r"""Standard normal CDF :math:`\Phi(x) = \tfrac12 \operatorname{erfc}(-x/\sqrt2)`.

    ``erfc`` keeps full relative precision in the lower tail, where ``(1 + erf)/2`` would not.
    """
    erfc: Tensor = torch.special.erfc(-x * _SQRT_HALF)
    return 0.5 * erfc


def normal_pdf(x: Tensor) -> Tensor:
    r"""Standard normal density :math:`\phi(x) = e^{-x^2/2}/\sqrt{2\pi}`."""
    return torch.exp(-0.5 * x * x - _LOG_SQRT_2PI)


def clip_correlation(rho: Tensor, eps: float | None = None) -> Tensor:
    r"""Clip correlations to :math:`(-1 + \epsilon, 1 - \epsilon)`.

    ``eps`` defaults to a dtype-aware margin (``1e-6`` in float64, ``1e-4`` in float32) so that
    :math:`\bar\rho = \sqrt{1 - \rho^2}` and its gradient stay finite.
    """
    if eps is None:
        eps = 1e-6 if rho.dtype == torch.float64 else 1e-4
    return rho.clamp(-1 + eps, 1 - eps)


def asin_residual_over_x3(x: Tensor) -> Tensor:
    r""":math:`(\arcsin x - x)/x^3`, smooth on :math:`[-1, 1]` with limit :math:`1/6` at 0.

    A Taylor series is used for :math:`|x| <` 0.25 (where the direct formula cancels) and the
    direct formula elsewhere; ``torch.where`` is fed safe arguments on both branches so that the
    unused branch cannot inject NaN gradients.
    """
    small = x.abs() < _SERIES_CUTOFF
    xs = torch.where(small, x, torch.zeros_like(x))
    x2 = xs * xs
    series = torch.zeros_like(x)
    for c in reversed(_ASIN_SERIES):
        series = series * x2 + c
    xl = torch.where(small, torch.ones_like(x), x)
    direct = (torch.asin(xl) - xl) / (xl * xl * xl)
    return torch.where(small, series, direct)


def asin_over_x(x: Tensor) -> Tensor:
    r""":math:`\arcsin(x)/x`, with value 1 and finite gradient at :math:`x = 0`."""
    return 1 + x * x * asin_residual_over_x3(x)
