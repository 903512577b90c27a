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
    "flush_positive",
    "flushed_exp",
    "lambert_w_of_exp",
    "normal_cdf",
    "normal_pdf",
    "row_logsumexp",
    "row_softmax",
    "sign_select",
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


def flush_positive(x: Tensor) -> Tensor:
    """Non-negative ``x`` with the entries below :func:`tail_cutoff` zeroed.

    :func:`flush` for values known to be non-negative, by one ``threshold`` (a vectorised select,
    cheaper on a CPU than ``hardshrink``). NaN passes through.
    """
    return torch.nn.functional.threshold(x, tail_cutoff(x.dtype), 0.0)


def flushed_exp(x: Tensor) -> Tensor:
    r""":math:`e^x`, zero below :func:`tail_cutoff` (as :func:`normal_pdf`); NaN stays NaN.

    Subnormals stall CPUs and carry no information, and on CPU ``exp`` itself takes a slow path
    wherever its result underflows (100-200x slower per element below :math:`\log(\text{tiny})`,
    float32 ``exp(-88)`` and ``exp(-1e3)``, torch 2.13, AVX-512; 20x at :math:`-\infty`). So the
    argument is clamped just below the log of the cutoff (a normal result) and the results below
    the cutoff are zeroed (:func:`flush_positive`).

    Examples:
        >>> flushed_exp(torch.tensor([0.0, -1000.0, -float("inf")])).tolist()
        [1.0, 0.0, 0.0]
    """
    return flush_positive(x.clamp_min(math.log(tail_cutoff(x.dtype)) - 1.0).exp())


def row_logsumexp(x: Tensor) -> Tensor:
    r""":math:`\log\sum_k e^{x_k}` over the last dimension (kept), for finite ``x``.

    On CPU :math:`m + \log\sum_k e^{x_k - m}`, :math:`m = \max_k x_k`, with :func:`flushed_exp`:
    ``torch.logsumexp`` exponentiates the differences as they are, and rows whose entries lie
    tens of nats apart send ``exp`` down its slow underflow path (with logits of scale 30, as a
    trained classifier head's: 3.3x the time of this on ``[1401, 10]``, 4.9x on
    ``[1401, 6, 10]``; at scale 1 this is 10-20 % slower). Terms below :func:`tail_cutoff`
    relative to the largest are dropped, which no sum can see. Elsewhere ``torch.logsumexp``.
    """
    if x.device.type != "cpu":
        return torch.logsumexp(x, -1, keepdim=True)
    top = x.detach().amax(-1, keepdim=True)
    return top + flushed_exp(x - top).sum(-1, keepdim=True).log()


#: Last-dimension length below which :func:`row_softmax` avoids ``torch.softmax`` on CPU.
SHORT_ROW = 16


def row_softmax(x: Tensor) -> Tensor:
    r""":math:`\operatorname{softmax}` over the last dimension: the execution policy of one formula.

    :math:`e_k / \sum_j e_j`, :math:`e_k = e^{x_k - \max_j x_j}` (by :func:`flushed_exp`),
    written out on CPU when the last dimension is shorter than :data:`SHORT_ROW` (class counts),
    ``torch.softmax`` otherwise: ATen's CPU softmax leaves its vectorised path for such short
    rows and ran 3-6x slower, forward and backward, on ``[1401, 10]`` to ``[66666, 3]`` float32
    tensors (one thread, torch 2.13), 5-7x with logits of scale 30. The same arithmetic, so the
    same values to rounding (tested).
    """
    if x.device.type == "cpu" and x.shape[-1] < SHORT_ROW:
        e = flushed_exp(x - x.detach().amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)
    return torch.softmax(x, -1)


def sign_select(first: Tensor, second: Tensor, at: Tensor) -> Tensor:
    r"""``first`` where ``at > 0``, ``second`` where ``at < 0``, their mean where ``at == 0``.

    A select without branches: ``torch.lerp`` with the weight :math:`(1 + \operatorname{sign}
    (at))/2`, exact at the weights 0 and 1 when both inputs are finite. On CPU ``torch.where``
    branches per element: 10x slower than this on a random mask (the softplus series bound took
    11 % longer with it on a training head's logits). For a choice between two forms of one
    quantity, equal (to their accuracy) where ``at`` is 0.
    """
    return torch.lerp(second, first, 0.5 + 0.5 * at.sign())


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


def lambert_w_of_exp(log_x: Tensor, iterations: int = 8) -> Tensor:
    r""":math:`W(e^{L})`, the solution :math:`w > 0` of :math:`w + \log w = L` (Newton's method).

    Started at :math:`w = L - \log L` for :math:`L > 1` and :math:`e^L` below; the iteration is
    monotone from there and 8 steps reach full precision in float64 for :math:`L \le 10^{4}`.
    """
    big = log_x > 1.0
    safe = torch.where(big, log_x, torch.ones_like(log_x))
    w = torch.where(big, safe - safe.log(), log_x.clamp_max(1.0).exp())
    for _ in range(iterations):
        w = w - (w + w.log() - log_x) * w / (w + 1.0)
    return w
