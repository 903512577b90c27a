r"""Special functions for moment propagation, written to stay finite in float32 and float64.

All functions are elementwise and differentiable; ratios with removable singularities at
:math:`\rho = 0` are evaluated through series so that values *and gradients* stay finite there.

**No subnormal floats.** Gaussian tails underflow: :math:`\Phi(-14)` is below float32's normal
range, and many CPUs take a microcode assist (tens of cycles) for every subnormal operand or
result, which made whole training steps several times slower. Every moment formula therefore
returns values (and gradients) that are either exactly zero or at least :func:`tail_cutoff` in
magnitude: :func:`flush` (one ``hardshrink``) zeroes what lies below it, and :func:`normal_cdf`
and :func:`normal_pdf` clamp their arguments where the result would underflow anyway, so not
even their intermediates are subnormal. The cutoff, ``tiny / eps`` of the dtype, leaves a product
with any factor above ``eps`` in the normal range.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "asin_over_x",
    "asin_residual_over_x3",
    "clip_correlation",
    "flush",
    "flush_gradient",
    "normal_cdf",
    "normal_pdf",
    "tail_argument",
    "tail_cutoff",
]

_SQRT_HALF = math.sqrt(0.5)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
# Coefficients of (asin(x) - x) / x^3 = sum_k c_k x^(2k): (2k+2)! / (4^(k+1) ((k+1)!)^2 (2k+3)).
_ASIN_SERIES = tuple(
    math.factorial(2 * n) / (4**n * math.factorial(n) ** 2 * (2 * n + 1)) for n in range(1, 13)
)
# Below this |x| the series (12 terms, truncation error < 1e-16) beats the cancelling direct formula.
_SERIES_CUTOFF = 0.25


def tail_cutoff(dtype: torch.dtype) -> float:
    r"""Smallest nonzero magnitude a moment formula returns: ``finfo.tiny / finfo.eps``.

    About :math:`10^{-31}` in float32 and :math:`10^{-292}` in float64: values below it are
    flushed to exact zeros (:func:`flush`), so that neither they nor their products with
    factors above ``eps`` are subnormal.
    """
    info = torch.finfo(dtype)
    return float(info.tiny / info.eps)


def flush(x: Tensor) -> Tensor:
    r""":math:`x` with every entry of magnitude below :func:`tail_cutoff` set to exactly zero.

    One ``hardshrink`` (NaN and infinities pass through unchanged); differentiable, with zero
    gradient where an entry was flushed.

    Examples:
        >>> flush(torch.tensor([1e-40, -1e-33, 1e-30, 2.0])).tolist()
        [0.0, 0.0, 1.0000000031710769e-30, 2.0]
    """
    return torch.nn.functional.hardshrink(x, tail_cutoff(x.dtype))


class _FlushGradient(torch.autograd.Function):
    """The identity; its backward flushes the incoming gradient (:func:`flush`)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> Tensor:
        return flush(grad)


def flush_gradient(x: Tensor) -> Tensor:
    r""":math:`x` itself, whose gradient leaves with the entries below :func:`tail_cutoff` zeroed.

    For closed forms whose backward multiplies small factors (tail densities, softmax weights
    of far-behind classes): their gradients leave subnormal-free, as the moment formulas' do.
    A no-op outside autograd.

    Examples:
        >>> x = torch.tensor([1.0, 2.0], requires_grad=True)
        >>> (flush_gradient(x) * torch.tensor([1e-40, 3.0])).sum().backward()
        >>> x.grad.tolist()
        [0.0, 3.0]
    """
    if not (torch.is_grad_enabled() and x.requires_grad):
        return x
    return _FlushGradient.apply(x)  # type: ignore[no-any-return]  # Function.apply returns Any


def tail_argument(dtype: torch.dtype) -> float:
    """``c`` with ``exp(-c**2) = tail_cutoff``: beyond it a normal tail is flushed anyway."""
    return math.sqrt(-math.log(tail_cutoff(dtype)))


def normal_cdf(x: Tensor) -> Tensor:
    r"""Standard normal CDF :math:`\Phi(x) = \tfrac12 \operatorname{erfc}(-x/\sqrt2)`.

    ``erfc`` keeps full relative precision in the lower tail, where ``(1 + erf)/2`` would not.
    Values below :func:`tail_cutoff` are exact zeros: the argument of ``erfc`` is clamped to
    :math:`\pm c`, :math:`e^{-c^2}` = the cutoff, beyond which the value is flushed to 0 or
    rounds to 1 anyway (CPU ``erfc`` is slow on arguments that underflow, and the derivative
    :math:`\phi(x)` there would be subnormal), and the result is flushed.
    """
    c = tail_argument(x.dtype)
    arg = (-x * _SQRT_HALF).clamp(-c, c)
    return flush(0.5 * torch.special.erfc(arg))


def normal_pdf(x: Tensor) -> Tensor:
    r"""Standard normal density :math:`\phi(x) = e^{-x^2/2}/\sqrt{2\pi}`, flushed like :func:`normal_cdf`."""
    low = math.log(tail_cutoff(x.dtype)) - 1.0  # exp of it is below the cutoff: flushed to 0
    return flush(torch.exp((-0.5 * x * x - _LOG_SQRT_2PI).clamp_min(low)))


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
