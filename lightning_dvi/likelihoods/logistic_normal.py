r"""Logistic and softplus integrals against a Gaussian, and the training objectives built on them.

For :math:`x \sim \mathcal N(m, v)`, :math:`s = \sqrt v`, :math:`a = m/s`:

* :func:`softplus_normal_bound`: an **upper bound** on :math:`\mathbb E\operatorname{softplus}(x)`
  that is exact to a relative :math:`8\cdot10^{-5}` (measured; the proof is below), so
  :math:`-\text{it}` is a certified lower bound on :math:`\mathbb E\log\sigma(x)`;
* :func:`sigmoid_normal_mean`: :math:`\mathbb E\,\sigma(x)` to about :math:`10^{-5}` (the
  Bernoulli predictive);
* :func:`bernoulli_expected_log_prob` and :func:`categorical_bound_expected_log_prob`: expected
  log-likelihoods that are **never above the truth** (for any mean and variance), so an optimiser
  cannot gain by inflating variances, as it can with the delta method.

Series with an accelerated sum. With :math:`u = e^{-|x|} \in (0, 1]`,
:math:`\operatorname{softplus}(x) = \operatorname{relu}(x) + \log(1 + u)` and
:math:`\log(1+u) = \sum_{k\ge1} (-1)^{k+1} u^k / k`. The Gaussian moments

.. math::
    T_k = \mathbb E[e^{-kx}\,1\{x>0\}] = e^{-km + k^2v/2}\,\Phi(a - ks),\qquad
    U_k = \mathbb E[e^{kx}\,1\{x<0\}] = e^{km + k^2v/2}\,\Phi(-a - ks)

are closed forms (evaluated as :math:`\tfrac12 e^{-a^2/2}\operatorname{erfcx}(\cdot)`, which
neither overflows nor cancels), and :math:`\mathbb E\operatorname{relu}(x) = m\Phi(a) + s\phi(a)`.
The alternating series :math:`R = \sum_{j\ge0}(-1)^j c_j`, :math:`c_j = (T_{j+1} + U_{j+1})/(j+1)
= \int_0^1 t^j\,P(u > t)\,dt`, has coefficients that are moments of a positive measure on
:math:`[0, 1]`, so the Cohen–Rodriguez Villegas–Zagier acceleration (Experimental Math. 9, 2000,
Algorithm 1) applies: with fixed weights :math:`w_j` built from the shifted Chebyshev polynomial
of degree :math:`n`, :math:`|R - \sum_{j<n} w_j c_j| \le R/d_n`, :math:`d_n = \cosh(n\,
\operatorname{arccosh}3) = 19601` for :math:`n = 6`. Hence

.. math::
    \mathbb E\operatorname{softplus}(x) \le \mathbb E\operatorname{relu}(x)
    + \frac{\sum_{j<n} w_j c_j}{1 - 1/d_n},

an upper bound whose relative excess is at most :math:`2/d_n \approx 10^{-4}` (measured
:math:`7.9\cdot10^{-5}` against ``scipy.integrate.quad`` over :math:`m \in [-20, 20]`,
:math:`s \in [10^{-3}, 31.6]`, float64). :math:`\mathbb E\sigma(x) = \Phi(a) + \sum_j w_j
(U_{j+1} - T_{j+1})` accelerates the same way (:math:`\sigma(-|x|) = \sum_k (-1)^{k+1}u^k`).

Two cheaper upper bounds are exact enough for small variances: Jensen's
:math:`\operatorname{softplus}(m + v/2)` (:math:`\mathbb E\log(1+e^x) \le \log(1 + \mathbb E
e^x)`) and the fourth-order Taylor bound :math:`\operatorname{softplus}(m) + \sigma'(m)\,v/2 +
v^2/192` (odd terms vanish; the Lagrange remainder is at most
:math:`\sup\sigma'''\cdot\mathbb E(x-m)^4/24 = (1/24)(3v^2)/24`). Their minimum is within a
relative :math:`3\cdot10^{-4}` of the truth for :math:`v \le 0.1`; the series is evaluated where
:math:`v` exceeds :data:`SERIES_VARIANCE` (on CPU only on those elements; elsewhere on all and
selected, which gives the same numbers without a host synchronisation).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from ..moments import policy
from ..moments.special import (
    flush_gradient,
    flush_positive,
    flushed_exp,
    row_logsumexp,
    row_softmax,
    sign_select,
)

__all__ = [
    "SERIES_VARIANCE",
    "bernoulli_expected_log_prob",
    "categorical_bound_expected_log_prob",
    "categorical_tight_expected_log_prob",
    "sigmoid_normal_mean",
    "softplus_normal_bound",
]

_SQRT_HALF = math.sqrt(0.5)
_INV_SQRT_PI = 1.0 / math.sqrt(math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
#: Variance above which the accelerated series replaces the cheap (Jensen / Taylor) bounds.
SERIES_VARIANCE = 0.1
#: Variance above which the asymptotic expansion replaces the series (its remainder bound is
#: then below 7e-5 nats).
ASYMPTOTIC_VARIANCE = 25.0
# eta(2j + 2) = (1 - 2^{-2j-1}) zeta(2j + 2), j = 0..4: the moments
# int t^{2j} log(1 + e^{-|t|}) dt = 2 (2j)! eta(2j + 2).
_ETA = (
    math.pi**2 / 12,
    7 * math.pi**4 / 720,
    31 * math.pi**6 / 30240,
    127 * math.pi**8 / 1209600,
    73 * math.pi**10 / 6842880,
)
# sup of phi^(8) = He_8(0) phi(0) = 105 / sqrt(2 pi): the remainder of the expansion.
_PHI8_MAX = 105.0 / math.sqrt(2.0 * math.pi)
#: Upper bound on ``sigma'''`` (attained where ``sigma = (3 - sqrt 3)/6``): the Taylor remainder.
_SIGMOID_D3_MAX = 1.0 / 24.0
# |a| beyond which e^{-a^2/2} is below every dtype's resolution of the other terms.
_A_MAX = 30.0
# erfcx(z) = exp(z^2) erfc(z) below this; the asymptotic series (relative error < 5e-7) above.
_ERFCX_SPLIT = 6.0


def _crvz_weights(n: int) -> tuple[tuple[float, ...], float]:
    """Weights ``w_j`` of the accelerated alternating sum and the error divisor ``d_n``."""
    d = (3.0 + math.sqrt(8.0)) ** n
    d = (d + 1.0 / d) / 2.0
    b, c, weights = -1.0, -d, []
    for k in range(n):
        c = b - c
        weights.append(c / d)
        b = (k + n) * (k - n) * b / ((k + 0.5) * (k + 1))
    return tuple(weights), d


_TERMS = 6
_WEIGHTS, _D_N = _crvz_weights(_TERMS)
#: ``1 / (1 - 1/d_n)``: turns the accelerated sum into an upper bound of the series.
_UPPER = 1.0 / (1.0 - 1.0 / _D_N)
_WEIGHTS_SUM = sum(_WEIGHTS)


def _tracing() -> bool:
    """Whether torch.compile, torch.export or ``torch.jit.trace`` is tracing (no host reads then)."""
    return bool(policy.tracing() or torch.compiler.is_exporting() or torch.jit.is_tracing())


def _erfcx_nonneg(z: Tensor) -> Tensor:
    r""":math:`\operatorname{erfcx}(z) = e^{z^2}\operatorname{erfc}(z)` for :math:`z \ge 0`.

    ``torch.special.erfcx`` is about 15x slower than ``erfc`` on CPU; below
    :data:`_ERFCX_SPLIT` the product is exact in floating point, above it the asymptotic series
    :math:`\frac{1}{\sqrt\pi z}(1 - \frac1{2z^2} + \frac3{4z^4} - \frac{15}{8z^6} +
    \frac{105}{16z^8})` has relative error below :math:`945/(32 z^{10}) < 5\cdot10^{-7}`.
    Both branches get clamped arguments, so neither can inject an Inf or NaN gradient.
    """
    zs, zl = z.clamp_max(_ERFCX_SPLIT), z.clamp_min(_ERFCX_SPLIT)
    direct = torch.exp(zs * zs) * policy.erfc(zs)
    r = 1.0 / (zl * zl)
    asymptotic = (_INV_SQRT_PI / zl) * (1 + r * (-0.5 + r * (0.75 + r * (-1.875 + r * 6.5625))))
    return sign_select(direct, asymptotic, _ERFCX_SPLIT - z)  # both finite, equal at the split


def _series_moments(mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""``(s, a, e^{-a²/2}/2, M)`` with ``M[0, j, ...] = T_{j+1}``, ``M[1, j, ...] = U_{j+1}``.

    :math:`T_k = \tfrac12 e^{-a^2/2}\operatorname{erfcx}(z)`, :math:`z = (ks - a)/\sqrt2`; for
    :math:`z < 0` through :math:`\operatorname{erfcx}(z) = 2e^{z^2} - \operatorname{erfcx}(-z)`,
    whose first part is :math:`e^{-km + k^2v/2} \le 1` there. :math:`U_k` is :math:`T_k` at
    :math:`-m`. Both are computed in one stacked pass (half the elementwise ops of two). ``M`` is
    ``[2, n, *batch]``: the series' two short dimensions lead, so that every elementwise op runs
    along the long batch dimension (trailing ``[2, n]`` dimensions kept the CPU's broadcasting
    ops out of their vectorised loops: this function took 1.5x as long on ``[1401, 10]``).
    """
    floor = torch.finfo(mean.dtype).tiny ** 0.5
    s = var.clamp_min(floor * floor).sqrt()
    a = (mean / s).clamp(-_A_MAX, _A_MAX)
    half_gauss = 0.5 * flushed_exp(-0.5 * a * a)
    batch = (1,) * a.dim()
    k = torch.arange(1, _TERMS + 1, dtype=mean.dtype, device=mean.device).view(1, _TERMS, *batch)
    sign = torch.tensor([1.0, -1.0], dtype=mean.dtype, device=mean.device).view(2, 1, *batch)
    ks = k * s  # [1, n, *batch]
    z = (ks - sign * a) * _SQRT_HALF  # [2, n, *batch]
    tail = half_gauss * _erfcx_nonneg(z.abs())
    direct = flushed_exp((k * (0.5 * ks * s - sign * mean)).clamp_max(0.0))
    return s, a, half_gauss, sign_select(tail, direct - tail, z)  # the two forms agree at z = 0


def _contract(weights: Tensor, moments: Tensor) -> Tensor:
    """``sum_i weights[..., i] M_i`` over the ``2n`` moments of :func:`_series_moments`: ``[..., *batch]``."""
    out: Tensor = torch.tensordot(weights, moments.flatten(0, 1), dims=([weights.dim() - 1], [0]))
    return out


def _series_contractions(dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[2n, 3]``: the value, mean-gradient and variance-gradient sums over ``(T, U)``."""
    k = torch.arange(1, _TERMS + 1, dtype=torch.float64)
    w = torch.tensor(_WEIGHTS, dtype=torch.float64)
    value, dmean, dvar = torch.cat([w / k, w / k]), torch.cat([-w, w]), torch.cat([w * k, w * k])
    return (torch.stack([value, dmean, dvar], -1) * _UPPER).to(dtype=dtype, device=device)


class _SoftplusSeriesBound(torch.autograd.Function):
    r"""The accelerated-series upper bound on :math:`\mathbb E\operatorname{softplus}(x)`.

    One autograd node with the closed-form gradient of the same expression (about half the work
    of differentiating ~40 elementwise ops): with :math:`N_0 = \phi(a)/s`, the density of
    :math:`x` at 0, :math:`\partial_m T_k = N_0 - kT_k`, :math:`\partial_m U_k = kU_k - N_0`,
    :math:`\partial_v(T_k + U_k) = \tfrac12(k^2(T_k + U_k) - 2kN_0)`, and for the ReLU part
    :math:`\partial_m = \Phi(a)`, :math:`\partial_v = N_0/2`. The three weighted sums over
    :math:`k` are one matrix product.
    """

    @staticmethod
    def forward(ctx: FunctionCtx, mean: Tensor, var: Tensor) -> Tensor:
        s, a, half_gauss, moments = _series_moments(mean, var)
        sums = _contract(_series_contractions(mean.dtype, mean.device).t(), moments)
        value, grad_mean, grad_var = sums.unbind(0)
        cdf = torch.special.ndtr(a)
        density0 = _SQRT_2_OVER_PI * half_gauss / s  # phi(a) / s
        grad_var = 0.5 * (grad_var - (2.0 * _WEIGHTS_SUM * _UPPER - 1.0) * density0)
        ctx.save_for_backward(cdf + grad_mean, grad_var)
        out: Tensor = mean * cdf + var * density0 + value
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor, Tensor]:
        grad_mean, grad_var = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        return grad * grad_mean, grad * grad_var


def _softplus_series_bound(mean: Tensor, var: Tensor) -> Tensor:
    """The accelerated-series upper bound on E softplus (valid, and tight, for every variance)."""
    return _SoftplusSeriesBound.apply(mean, var)  # type: ignore[no-any-return]  # Function.apply returns Any


def _cheap_softplus_bound(mean: Tensor, var: Tensor) -> Tensor:
    """``min(Jensen, fourth-order Taylor)`` upper bound on E softplus (tight for small ``var``).

    ``sigmoid`` and ``softplus`` of a very negative mean are subnormal: flushed (the final
    bound is flushed below the same cutoff).
    """
    sig = flush_positive(torch.sigmoid(mean))
    taylor = flush_positive(torch.nn.functional.softplus(mean)) + sig * (1 - sig) * (0.5 * var)
    taylor = taylor + (_SIGMOID_D3_MAX / 8.0) * var * var
    return torch.minimum(taylor, flush_positive(torch.nn.functional.softplus(mean + 0.5 * var)))


def _where_needed(need: Tensor, fn: Callable[..., Tensor], args: tuple[Tensor, ...]) -> Tensor:
    """``where(need, fn(*args), args[-1])``: the execution policy of the costly branches.

    ``need`` masks the leading dimensions of every argument; the last argument is the value
    where nothing more is needed; ``fn`` must be finite (with finite gradients) everywhere.
    On CPU ``fn`` runs on the needed rows only (a gather and a differentiable scatter) when they
    are fewer than half, else on all rows and is selected; on other devices always the latter,
    with no data-dependent shapes and no host synchronisation. All give the same numbers.
    """
    fallback = args[-1]
    if fallback.device.type == "cpu" and not _tracing():
        count = int(need.sum())
        if count == 0:
            return fallback
        if 2 * count < need.numel():
            return fallback.masked_scatter(need, fn(*(x[need] for x in args)))
    return torch.where(need, fn(*args), fallback)


def _series_or_cheap(mean: Tensor, var: Tensor, cheap: Tensor) -> Tensor:
    return torch.minimum(_softplus_series_bound(mean, var), cheap)


def _asymptotic_or_cheap(mean: Tensor, var: Tensor, cheap: Tensor) -> Tensor:
    r"""For large variances: :math:`\mathbb E\operatorname{relu}(x)` plus an expansion of the rest.

    With :math:`r(t) = \log(1 + e^{-|t|})` (even, integrable),
    :math:`\mathbb E\,r(x) = \frac1s\int r(t)\,\phi(\frac{t - m}{s})\,dt`; Taylor-expanding
    :math:`\phi` around :math:`-a` in :math:`t/s` (odd terms vanish against the even
    :math:`r`) with the Lagrange remainder of order 8 gives the upper bound

    .. math::
        \mathbb E\,r(x) \le \frac{2\phi(a)}{s}\sum_{j=0}^{3}
            \frac{\operatorname{He}_{2j}(a)\,\eta(2j+2)}{s^{2j}}
            + \frac{2\sup\phi^{(8)}\,\eta(10)}{s^9},

    :math:`\eta` the Dirichlet eta function, :math:`\sup\phi^{(8)} = 105/\sqrt{2\pi}`:
    above :data:`ASYMPTOTIC_VARIANCE` the excess is below :math:`7\cdot10^{-5}` (measured
    against quadrature; the remainder term itself is the bound on it).
    """
    var = var.clamp_min(ASYMPTOTIC_VARIANCE)  # finite where it is not used (see _where_needed)
    s = var.sqrt()
    a = mean / s
    a2 = a * a
    phi = flushed_exp(-0.5 * a2) * (1.0 / math.sqrt(2.0 * math.pi))
    inv_s2 = 1.0 / var
    hermite = (a2 * (a2 * (a2 - 15.0) + 45.0) - 15.0) * _ETA[3]  # He_6 eta(8), Horner in 1/s^2
    hermite = hermite * inv_s2 + (a2 * (a2 - 6.0) + 3.0) * _ETA[2]
    hermite = hermite * inv_s2 + (a2 - 1.0) * _ETA[1]
    hermite = hermite * inv_s2 + _ETA[0]
    remainder = (2.0 * _PHI8_MAX * _ETA[4]) * inv_s2**4 / s
    relu = mean * torch.special.ndtr(a) + s * phi
    return torch.minimum(relu + 2.0 * phi * hermite / s + remainder, cheap)


def softplus_normal_bound(mean: Tensor, var: Tensor | float) -> Tensor:
    r"""Upper bound on :math:`\mathbb E\operatorname{softplus}(x)`, :math:`x\sim\mathcal N(m, v)`.

    The minimum of Jensen's :math:`\operatorname{softplus}(m + v/2)`, the fourth-order Taylor
    bound :math:`\operatorname{softplus}(m) + \sigma'(m)v/2 + v^2/192` and, for
    :math:`v >` :data:`SERIES_VARIANCE`, the accelerated series of the module docstring (up to
    :data:`ASYMPTOTIC_VARIANCE`) or the asymptotic expansion of
    :func:`_asymptotic_or_cheap` (above it). Every branch is an upper bound, so the result is
    one; its relative excess over the exact integral is at most :math:`4\cdot10^{-4}` (at most
    :math:`8\cdot10^{-5}` where the series runs, :math:`7\cdot10^{-5}` nats absolute above
    :data:`ASYMPTOTIC_VARIANCE`), measured against ``scipy.integrate.quad`` in float64.

    Args:
        mean: :math:`m`, any shape.
        var: :math:`v \ge 0`, broadcastable to ``mean``.

    Returns:
        The bound, the broadcast shape.

    Examples:
        >>> m = torch.tensor([0.0, 3.0])
        >>> softplus_normal_bound(m, torch.zeros(2)).tolist() == torch.nn.functional.softplus(m).tolist()
        True
    """
    v = torch.as_tensor(var, dtype=mean.dtype, device=mean.device).clamp_min(0)
    mean, v = torch.broadcast_tensors(flush_gradient(mean), flush_gradient(v))
    flat = policy.flat_elementwise(softplus_normal_bound, mean, v)  # how it runs when traced
    if flat is not None:
        return flat
    cheap = _cheap_softplus_bound(mean, v)
    wide = v > ASYMPTOTIC_VARIANCE
    bound = _where_needed((v > SERIES_VARIANCE) & ~wide, _series_or_cheap, (mean, v, cheap))
    bound = _where_needed(wide, _asymptotic_or_cheap, (mean, v, bound))
    # Values below tiny/eps (1e-31 in float32) are flushed to zero, so neither they nor their
    # gradients are ever subnormal (the bound is positive; the absolute change is below it).
    return flush_positive(bound)


def sigmoid_normal_mean(mean: Tensor, var: Tensor | float) -> Tensor:
    r""":math:`\mathbb E\,\sigma(x)`, :math:`x\sim\mathcal N(m, v)`: the Bernoulli predictive.

    :math:`\Phi(a) + \sum_j w_j(U_{j+1} - T_{j+1})` (module docstring): absolute error below
    :math:`3\cdot10^{-5}` for every mean and variance (measured against quadrature; MacKay's
    probit approximation :math:`\sigma(m/\sqrt{1 + \pi v/8})` is off by up to 0.017). Exactly
    :math:`\sigma(m)` at :math:`v = 0`.

    Args:
        mean: :math:`m`, any shape.
        var: :math:`v \ge 0`, broadcastable to ``mean``.

    Returns:
        Probabilities in :math:`[0, 1]`, the broadcast shape.

    Examples:
        >>> sigmoid_normal_mean(torch.tensor([0.0, 2.0]), torch.tensor([100.0, 1.0]))
        tensor([0.5000, 0.8445])
    """
    v = torch.as_tensor(var, dtype=mean.dtype, device=mean.device).clamp_min(0)
    mean, v = torch.broadcast_tensors(mean, v)
    _, a, _, moments = _series_moments(mean, v)
    dmean = _series_contractions(mean.dtype, mean.device)[:, 1] / _UPPER
    probs = torch.special.ndtr(a) + _contract(dmean, moments)
    return torch.where(v > 0, probs, torch.sigmoid(mean)).clamp(0.0, 1.0)


def bernoulli_expected_log_prob(mean: Tensor, var: Tensor | float, y: Tensor) -> Tensor:
    r"""Lower bound on :math:`\mathbb E\log\operatorname{Bern}(y\mid\sigma(f))`, :math:`f\sim\mathcal N(m, v)`.

    :math:`\log p(y\mid f) = -\operatorname{softplus}(-(2y - 1)f)`, so

    .. math::
        \mathbb E\log p(y\mid f) \ge -\texttt{softplus\_normal\_bound}(-(2y-1)m,\ v),

    never above the truth and within a relative :math:`3\cdot10^{-4}` of it.

    Args:
        mean: logit means :math:`m`.
        var: logit variances :math:`v`.
        y: labels in :math:`\{0, 1\}` (any dtype), broadcastable to ``mean``.

    Returns:
        The bound, the broadcast shape of the inputs.
    """
    sign = 2.0 * y.to(mean.dtype) - 1.0
    return -softplus_normal_bound(-sign * mean, var)


def _label_terms(mean: Tensor, cov: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""``(mu_y, C_{.y}, C_yy, diag C)`` for labels ``y`` and a full or diag ``cov``."""
    index = y.long().unsqueeze(-1)
    mean_y = mean.gather(-1, index)
    if cov.shape == mean.shape:  # diag: C_ky = 0 for k != y
        var_y = cov.gather(-1, index)
        return mean_y, torch.zeros_like(cov).scatter(-1, index, var_y), var_y, cov
    k = mean.shape[-1]
    if cov.shape != (*mean.shape, k):
        raise ValueError(
            f"logit covariance shape {tuple(cov.shape)} fits neither a diag ({tuple(mean.shape)}) "
            f"nor a full ({(*mean.shape, k)}) covariance for logits of shape {tuple(mean.shape)}"
        )
    row = cov.gather(-2, index.unsqueeze(-1).expand(*index.shape[:-1], 1, k)).squeeze(-2)
    return mean_y, row, row.gather(-1, index), cov.diagonal(dim1=-2, dim2=-1)


#: Temperatures :math:`t` tried by the tempered Jensen bound (any :math:`t \in (0, 1]` is valid).
TEMPERATURES = (1.0, 0.5, 0.25, 0.125, 0.0625, 0.03125)
#: Largest variance of a row above which temperatures below 1 are tried.
TEMPER_VARIANCE = 0.5


def _tempered(shift: Tensor, mean: Tensor, var: Tensor, at_one: Tensor) -> Tensor:
    """The best bound over :data:`TEMPERATURES` (``at_one`` is the value at ``t = 1``).

    The temperature is chosen without gradient (any choice is a valid bound, and at the best one
    the derivative in ``t`` vanishes), then the bound is evaluated once with gradient.
    """
    t = torch.tensor(TEMPERATURES, dtype=mean.dtype, device=mean.device)
    with torch.no_grad():
        tt = t.unsqueeze(-1)
        values = row_logsumexp(tt * mean.unsqueeze(-2) + (0.5 * tt * tt) * var.unsqueeze(-2))[
            ..., 0
        ]
        best = t[(values / t).argmin(-1)].unsqueeze(-1)
    lse = row_logsumexp(best * mean + (0.5 * best * best) * var) / best
    return torch.maximum((shift - lse).squeeze(-1), at_one)


def _jensen(shift: Tensor, mean: Tensor, var: Tensor) -> Tensor:
    r""":math:`\text{shift} - \frac1t\log\sum_k e^{t\mu_k + t^2v_k/2}` at the best :math:`t`.

    :math:`t = 1` unless the row's largest variance exceeds :data:`TEMPER_VARIANCE`; then the
    best of :data:`TEMPERATURES`.
    """
    at_one = (shift - row_logsumexp(mean + 0.5 * var)).squeeze(-1)
    need = var.amax(-1) > TEMPER_VARIANCE
    return _where_needed(need, _tempered, (shift, mean, var, at_one))


def categorical_bound_expected_log_prob(mean: Tensor, cov: Tensor, y: Tensor) -> Tensor:
    r"""Lower bound on :math:`\mathbb E\log\operatorname{softmax}(a)_y`, :math:`a\sim\mathcal N(\mu, C)`.

    The training objective of :class:`~lightning_dvi.likelihoods.Categorical` (``"bound"``).
    The largest of three bounds, each valid for every :math:`\mu` and :math:`C`, so the result
    never exceeds the true expectation (an optimiser cannot gain by inflating variances):

    1. **One-vs-each** (Titsias 2016): :math:`\operatorname{softmax}(a)_y \ge \prod_{k\ne y}
       \sigma(a_y - a_k)`, so with :math:`d_k = a_k - a_y \sim \mathcal N(\mu_k - \mu_y,
       C_{kk} + C_{yy} - 2C_{ky})`,
       :math:`\mathbb E\log\operatorname{softmax}(a)_y \ge -\sum_{k\ne y}\mathbb E
       \operatorname{softplus}(d_k)`, each term by :func:`softplus_normal_bound`. Exact for
       :math:`K = 2` (to :math:`3\cdot10^{-4}`) and tight when one class dominates, i.e. on
       well-classified points.
    2. **Tempered Jensen** (plain): :math:`\operatorname{logsumexp}(a) \le \frac1t
       \operatorname{logsumexp}(ta)` for :math:`t \in (0, 1]` and Jensen's inequality give
       :math:`\ge \mu_y - \frac1t\log\sum_k e^{t\mu_k + t^2C_{kk}/2}`; exact at :math:`C = 0`
       (ties at initialisation), and with small :math:`t` it grows like :math:`\sqrt v`, not
       :math:`v/2`.
    3. **Jensen on differences**: the same for :math:`\log\operatorname{softmax}(a)_y
       = -\operatorname{logsumexp}(d)` (:math:`d_y = 0`) at :math:`t = 1`: :math:`\ge -\log(1 +
       \sum_{k\ne y} e^{\mu_k - \mu_y + V_{ky}/2})` (tempering it gains less than one nat,
       and only around :math:`v = 10`, measured).

    Measured against Monte Carlo (docs/likelihoods_and_priors.md; ``recipes/categorical_closed_forms.py``):
    never above it by more than its standard error, for logit variances :math:`10^{-3}` to
    :math:`10^{3}`; below it by at most 0.009 nats for :math:`v \le 0.01`, 0.09 for
    :math:`v \le 0.1`, 0.8 at :math:`v = 1`; looser at large variances for :math:`K > 2`
    (a penalty on variance, which is the point).

    Args:
        mean: logit means ``[..., K]``.
        cov: logit covariance, full ``[..., K, K]`` or diag ``[..., K]``.
        y: integer labels ``[...]`` in ``[0, K)``.

    Returns:
        The bound ``[...]``.

    Raises:
        ValueError: if ``cov`` has neither the full nor the diag shape.

    Examples:
        >>> mean, y = torch.tensor([2.0, 0.0, 0.0]), torch.tensor(0)
        >>> exact = torch.log_softmax(mean, -1)[0]
        >>> bool((categorical_bound_expected_log_prob(mean, torch.zeros(3), y) - exact).abs() < 1e-6)
        True
    """
    mean, cov = flush_gradient(mean), flush_gradient(cov)  # the gradients leave flushed
    mean_y, cov_y, var_y, var = _label_terms(mean, cov, y)
    diff, diff_var = mean - mean_y, (var + var_y - 2 * cov_y).clamp_min(0)
    other = torch.ones_like(mean, dtype=torch.bool).scatter(-1, y.long().unsqueeze(-1), False)
    pairs = softplus_normal_bound(diff, diff_var)
    one_vs_each = -(pairs * other).sum(-1)
    plain = _jensen(mean_y, mean, var.clamp_min(0))
    pairwise = -row_logsumexp(diff + 0.5 * diff_var)[..., 0]  # t = 1: tempering adds < 1 nat
    return torch.maximum(one_vs_each, torch.maximum(plain, pairwise))


#: Probit constant of the shift search of :func:`_bouchard_shift`,
#: :math:`\mathbb E\,\sigma(x) \approx \sigma(m/\sqrt{1 + \pi v/8})` (MacKay 1992).
_PROBIT = math.pi / 8
#: Safeguarded Newton steps of :func:`_bouchard_shift` (from its bracket; measured: the root to
#: 1e-8 or better for logit variances 0.1 to 1000 and means up to 100 in scale).
_SHIFT_STEPS = 16
#: :math:`|z|` beyond which the shift's Newton steps take :math:`\sigma(z)` as 0 or 1.
_SHIFT_Z = 80.0
#: On CPU the steps stop early once no row's shift moves by more than this many ulps of
#: ``1 + |c|`` (measured: at its fixed point the iteration jitters by a few ulps).
_SHIFT_TOL = 64


def _reference_terms(mean: Tensor, cov: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(w·μ, μ - w·μ, s)`` of :math:`x_k = a_k - w^\top a`: :math:`s_k = C_{kk} - 2(Cw)_k + w^\top Cw`.

    ``cov`` is full ``[..., K, K]`` or diag ``[..., K]`` (validated by the caller); ``w`` is a
    fixed weight vector ``[..., K]`` (any function of the moments, not of :math:`a`).
    """
    if cov.shape == mean.shape:
        diag, cw = cov, cov * w
    else:
        diag, cw = cov.diagonal(dim1=-2, dim2=-1), (cov @ w.unsqueeze(-1)).squeeze(-1)
    return _reference_from(mean, diag, cw, w)


def _reference_from(
    mean: Tensor, diag: Tensor, cw: Tensor, w: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`_reference_terms` from ``diag C`` and ``C w``, ``[..., K]`` each."""
    wm = (w * mean).sum(-1, keepdim=True)
    return wm, mean - wm, (diag - 2 * cw + (w * cw).sum(-1, keepdim=True)).clamp_min(0)


def _tight_products(
    mean: Tensor, cov: Tensor, y: Tensor, p: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    r""":func:`_label_terms`' ``(μ_y, C_{·y}, C_yy, diag C)``, then ``C p`` and ``C 1/K``.

    What :func:`categorical_tight_expected_log_prob` reads of the covariance, each once. The
    products with :math:`p` and :math:`\mathbf 1/K` are elementwise products and row sums, not
    batched matrix products: for ``K = 10`` classes ``bmm`` and its backward (an outer product
    per row) cost 1.4x as much as these on a ``[1401, 10, 10]`` head, measured.
    """
    mean_y, row, var_y, diag = _label_terms(mean, cov, y)  # validates the shapes
    k = mean.shape[-1]
    if cov.shape == mean.shape:  # diag: C_kl = 0 for k != l
        return mean_y, row, var_y, diag, cov * p, cov * (1.0 / k)
    cp = (cov * p.unsqueeze(-2)).sum(-1)
    cu = (cov * (1.0 / k)).sum(-1)
    return mean_y, row, var_y, diag, cp, cu


def _bouchard_shift(mean: Tensor, var: Tensor) -> Tensor:
    r"""A near-optimal shift :math:`c` of Bouchard's bound, ``[..., 1]``.

    The bound :math:`c + \sum_k\mathbb E\operatorname{softplus}(x_k - c)` is smallest where
    :math:`\sum_k\mathbb E\,\sigma(x_k - c) = 1`. With the probit form of
    :math:`\mathbb E\,\sigma`, :math:`h(c) = \log\sum_k\sigma(z_k)`,
    :math:`z_k = \kappa_k(m_k - c)`, :math:`\kappa_k = (1 + \pi v_k/8)^{-1/2}`, decreases from
    :math:`\log K` to :math:`-\infty`; its root is bracketed by the second largest
    :math:`m_k` (two terms :math:`\ge \tfrac12`, :math:`h \ge 0`) and
    :math:`\max_k(m_k + \log K/\kappa_k)` (every term :math:`< 1/K`, :math:`h < 0`), and found
    by Newton steps that fall back to bisection when they leave the bracket (at most
    :data:`_SHIFT_STEPS`; on CPU, outside tracing, they stop once no row moves by more than
    :data:`_SHIFT_TOL` ulps, which Newton's quadratic convergence makes the fixed point to
    round-off: 9-10 steps on the digits classifier's logits, 5-7 on the softmax grid). Any
    :math:`c` gives a valid bound; this one is within the probit error of the best.

    The root is a smooth function of ``mean`` and ``var``, and carries its implicit gradient
    :math:`\partial c/\partial m_j = \pi_j`, :math:`\partial c/\partial v_j =
    -\tfrac{\pi}{16}\kappa_j^2(m_j - c)\,\pi_j`, with
    :math:`\pi_j \propto \kappa_j\sigma(z_j)\sigma(-z_j)` normalised to sum to one (computed
    as a softmax, so it is finite where the slope of :math:`h` underflows), so the bound's
    gradient is the derivative of its value.
    """
    with torch.no_grad():
        # the Newton steps run on the rows as they are (dim=-1) or, while traced on a CPU, on a
        # classes-first copy (dim=0; policy.classes_first): the same arithmetic, row by row
        rows, var_rows = policy.classes_first(mean), policy.classes_first(var)  # no grad here
        if rows is None or var_rows is None:
            c = _shift_newton(mean, var, -1)
        else:
            c = _shift_newton(rows, var_rows, 0).mT
        kappa = torch.rsqrt(1 + _PROBIT * var)
        # log sigma(z) + log sigma(-z) = -|z| - 2 log(1 + e^{-|z|}) (log1p and logsigmoid take
        # slow paths on CPU for large |z|; log(1 + u) is within an ulp of 1 of log1p(u) here)
        gap = mean - c
        size = (gap * kappa).abs()
        weight = row_softmax(kappa.log() - size - 2.0 * (1.0 + flushed_exp(-size)).log())
        var_coef = (-0.5 * _PROBIT) * kappa.square() * gap
    if not (mean.requires_grad or var.requires_grad):
        return c
    moved = (mean - mean.detach()) + var_coef * (var - var.detach())  # zero, with gradient
    return c + (weight * moved).sum(-1, keepdim=True)


def _shift_newton(mean: Tensor, var: Tensor, dim: int) -> Tensor:
    """:func:`_bouchard_shift`'s root :math:`c` by safeguarded Newton steps, per row along ``dim``.

    ``dim=-1`` for ``[..., K]`` rows (the result ``[..., 1]``), ``dim=0`` for a classes-first
    ``[K, N]`` copy (the result ``[1, N]``). No gradient.
    """
    kappa = torch.rsqrt(1 + _PROBIT * var)
    hi = (mean + math.log(mean.shape[dim]) / kappa).amax(dim, keepdim=True)
    # the second largest m_k (topk(2) on a short last dimension costs twice this on CPU)
    top = mean.argmax(dim, keepdim=True)
    lo = mean.scatter(dim, top, float("-inf")).amax(dim, keepdim=True)
    c = hi
    # On CPU (outside tracing) stop once no row moves by more than a few ulps: Newton converges
    # quadratically, so the last step left c at its fixed point to round-off and further steps
    # only oscillate in the last bits. Elsewhere the fixed count (no host synchronisation, no
    # data-dependent control flow under torch.compile / export).
    early = mean.device.type == "cpu" and not _tracing()
    eps = _SHIFT_TOL * torch.finfo(mean.dtype).eps
    for _ in range(_SHIFT_STEPS):
        # in [lo, hi] the sum of the sigmoids is at least 1/(K + 1) (at hi, every z_k is at
        # most -log K, one equal), so it is summed as it is, with z clamped to +-_SHIFT_Z
        # (beyond, sigmoid is 0 or 1 to every precision, and takes a slow path on CPU)
        z = ((mean - c) * kappa).clamp(-_SHIFT_Z, _SHIFT_Z)
        sig = torch.sigmoid(z)
        total = sig.sum(dim, keepdim=True)
        h = total.log()
        slope = -(sig * kappa * torch.sigmoid(-z)).sum(dim, keepdim=True) / total
        hi = torch.where(h <= 0, c, hi)
        lo = torch.where(h > 0, c, lo)
        step = c - h / slope.clamp_max(-torch.finfo(mean.dtype).tiny)
        previous = c
        c = torch.where((step >= lo) & (step <= hi), step, 0.5 * (lo + hi))
        if early and not bool(((c - previous).abs() > eps * (1 + c.abs())).any()):
            break
    return c


def _bouchard(mean: Tensor, var: Tensor) -> Tensor:
    r"""Upper bound on :math:`\mathbb E\log\sum_k e^{x_k}`, :math:`x_k\sim\mathcal N(m_k, v_k)`.

    Bouchard (2007): :math:`\log\sum_k e^{x_k} \le c + \log(1 + \sum_k e^{x_k - c})
    \le c + \sum_k\operatorname{softplus}(x_k - c)` for every :math:`c` (since
    :math:`1 + \sum_k u_k \le \prod_k(1 + u_k)` for :math:`u_k \ge 0`), each expectation by
    :func:`softplus_normal_bound` (an upper bound), at :func:`_bouchard_shift`'s :math:`c`
    (Knowles & Minka 2011 optimise :math:`c` the same way, with quadrature). ``[...]``.
    """
    c = _bouchard_shift(mean, var)
    return (c + softplus_normal_bound(mean - c, var).sum(-1, keepdim=True)).squeeze(-1)


def _tight_wide(
    mean_y: Tensor,
    mean: Tensor,
    diag: Tensor,
    cu: Tensor,
    shift: Tensor,
    ref: Tensor,
    ref_var: Tensor,
    at_one: Tensor,
) -> Tensor:
    r"""The two bounds of :func:`categorical_tight_expected_log_prob` for wide rows, and their max.

    ``diag`` and ``cu`` are :math:`\operatorname{diag} C` and :math:`C\mathbf 1/K`.
    """
    tempered = _tempered(shift, ref, ref_var, at_one)
    uniform = torch.full_like(mean, 1.0 / mean.shape[-1])
    centre, centred, centred_var = _reference_from(mean, diag, cu, uniform)
    bouchard = (mean_y - centre).squeeze(-1) - _bouchard(centred, centred_var)
    return torch.maximum(tempered, bouchard)


def categorical_tight_expected_log_prob(mean: Tensor, cov: Tensor, y: Tensor) -> Tensor:
    r"""A tighter lower bound on :math:`\mathbb E\log\operatorname{softmax}(a)_y`, :math:`a\sim\mathcal N(\mu, C)`.

    ``Categorical(method="tight")``. With any reference :math:`r = w^\top a` (a fixed
    :math:`w`, chosen from :math:`\mu` and :math:`C`), :math:`\log\operatorname{softmax}(a)_y
    = a_y - r - \log\sum_k e^{x_k}`, :math:`x_k = a_k - r \sim \mathcal N(m_k, s_k)`,
    :math:`m_k = \mu_k - w^\top\mu`, :math:`s_k = C_{kk} - 2(Cw)_k + w^\top Cw`, so every
    upper bound on :math:`\mathbb E\log\sum_k e^{x_k}` gives a lower bound. The result is the
    largest of three, each valid for every :math:`\mu` and :math:`C`:

    1. **Tempered Jensen at the softmax reference** :math:`w = p = \operatorname{softmax}(\mu)`.
       For :math:`t \in (0, 1]`,

       .. math::
           \mathbb E\log\sum_k e^{x_k} = \tfrac1t\,\mathbb E\log\Big(\sum_k e^{x_k}\Big)^t
           \le \tfrac1t\,\mathbb E\log\sum_k e^{t x_k}
           \le \tfrac1t\log\sum_k\mathbb E e^{t x_k}
           = \tfrac1t\operatorname{logsumexp}_k\big(t m_k + \tfrac{t^2}{2}s_k\big):

       the first step because :math:`(\sum_k u_k)^t \le \sum_k u_k^t` for :math:`u_k \ge 0`,
       :math:`t \le 1` (:math:`u \mapsto u^t` is concave with :math:`0^t = 0`, so subadditive),
       the second by Jensen (:math:`\log` is concave), the last is the log-normal mean. At
       :math:`t = 1` its expansion in :math:`C` is :math:`\operatorname{logsumexp}\mu +
       \tfrac12\sum_k p_k s_k`, and :math:`\sum_k p_k s_k = p^\top\operatorname{diag}C -
       2p^\top Cw + w^\top Cw` is smallest at :math:`w = p`, where it is the delta method's
       :math:`p^\top\operatorname{diag}C - p^\top Cp` (:func:`~lightning_dvi.likelihoods.
       functional.categorical_delta_expected_log_prob`): the bound is exact to second order,
       its gap :math:`O(v^2)`. Small :math:`t` makes it grow like :math:`\sqrt v`, not
       :math:`v/2`; :math:`t` is the best of :data:`TEMPERATURES` (any is a bound).
    2. **One-vs-each** (Titsias 2016), :math:`w = e_y`:
       :math:`\log(1 + \sum_{k\ne y}e^{x_k}) \le \sum_{k\ne y}\operatorname{softplus}(x_k)`,
       each expectation by :func:`softplus_normal_bound`: exact for :math:`K = 2` (to
       :math:`3\cdot10^{-4}`), tight when one class dominates.
    3. **Bouchard / Knowles–Minka at the mean reference** :math:`w = \mathbf 1/K` (the
       :math:`w` with the smallest :math:`\sum_k s_k`: a logit shift common to all classes
       drops out): :math:`\log\sum_k e^{x_k} \le c + \sum_k\operatorname{softplus}(x_k - c)`
       for every :math:`c` (:math:`1 + \sum_k u_k \le \prod_k (1 + u_k)`), at a
       near-optimal :math:`c` (:func:`_bouchard_shift`); it grows like the expected maximum
       of the logits, which the Jensen forms overestimate by a constant factor.

    Bounds 1 (tempered) and 3 are evaluated on rows whose largest logit variance exceeds
    :data:`TEMPER_VARIANCE` (elsewhere they do not improve on 1 at :math:`t = 1` and 2).
    :math:`t` is chosen without gradient (each fixed value gives a valid bound, and the value is
    the minimum over the grid, whose gradient is the chosen bound's); :math:`p` and :math:`c`
    (a smooth function of the moments) carry theirs, so the gradient is the derivative of the
    value.

    Measured against 200,000-draw Monte Carlo on ``recipes/categorical_tight_bound.py``'s grid
    (10 classes, 64 random rows per logit variance, float64): never above it by more than 3
    standard errors; mean gap 0.0003 nats at :math:`v = 0.1`, 0.05 at 1, 0.95 at 10 and 2.0
    at 100, against 0.019, 0.21, 2.1 and 9.4 for :func:`categorical_bound_expected_log_prob`,
    at about 2.5 times its cost per datum (value and gradient; 2.4x and 2.6x in two runs of the
    recipe on a loaded 2-core machine, one thread, after the early stop of the shift).

    Args:
        mean: logit means ``[..., K]``.
        cov: logit covariance, full ``[..., K, K]`` or diag ``[..., K]``.
        y: integer labels ``[...]`` in ``[0, K)``.

    Returns:
        The bound ``[...]``.

    Raises:
        ValueError: if ``cov`` has neither the full nor the diag shape.

    Examples:
        >>> mean, y = torch.tensor([2.0, 0.0, 0.0]), torch.tensor(0)
        >>> exact = torch.log_softmax(mean, -1)[0]
        >>> bool((categorical_tight_expected_log_prob(mean, torch.zeros(3), y) - exact).abs() < 1e-6)
        True
    """
    mean, cov = flush_gradient(mean), flush_gradient(cov)  # the gradients leave flushed
    p = row_softmax(mean)
    mean_y, cov_y, var_y, var, cp, cu = _tight_products(mean, cov, y, p)  # validates the shapes
    diff, diff_var = mean - mean_y, (var + var_y - 2 * cov_y).clamp_min(0)
    other = torch.ones_like(mean, dtype=torch.bool).scatter(-1, y.long().unsqueeze(-1), False)
    one_vs_each = -(softplus_normal_bound(diff, diff_var) * other).sum(-1)
    centre, ref, ref_var = _reference_from(mean, var, cp, p)
    shift = mean_y - centre
    jensen = (shift - row_logsumexp(ref + 0.5 * ref_var)).squeeze(-1)
    best = torch.maximum(one_vs_each, jensen)
    need = var.amax(-1) > TEMPER_VARIANCE
    return _where_needed(need, _tight_wide, (mean_y, mean, var, cu, shift, ref, ref_var, best))
