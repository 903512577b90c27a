r"""Moments of LeakyReLU, GELU, SiLU, Tanh, Sigmoid and Softplus applied to a Gaussian vector.

For :math:`a \sim \mathcal N(m, \Sigma)` and :math:`h = f(a)` elementwise, write :math:`v_j =
\Sigma_{jj}`, :math:`s_j = \sqrt{v_j}`.

**Diagonal (mean and variance).**

* LeakyReLU :math:`f(a) = \alpha a + (1-\alpha)\max(0, a)`: exact, from the ReLU moments and
  Stein's lemma :math:`\operatorname{Cov}(a, \max(0,a)) = v\,\Phi(m/s)`.
* Sigmoid, SiLU, Softplus, GELU (both forms) and Tanh (:math:`\tanh x = 2\sigma(2x) - 1`): one
  engine (:mod:`._quadrature`) with each activation's derivatives as its only input:
  16-node Gauss–Hermite quadrature for :math:`s \le 1.5` and, above, the activation's
  asymptote in closed form plus a 16-node Gauss–Laguerre rule on the remaining bump, with
  closed-form backward passes (Stein's lemma). Measured errors are in ``docs/moments.md``.

**Off-diagonal (full mode).** Mehler's expansion, three terms,
:math:`\operatorname{Cov}(h_j, h_l) \approx \sum_{k\le3}\Sigma_{jl}^k e_{jk}e_{lk}/k!` with
:math:`e_{jk} = E f^{(k)}(a_j)`, and the exact variances on the diagonal
(:func:`~lightning_dvi.moments._mehler.mehler_cov`: PSD, bounded memory). The truncation
error is bounded by Cauchy–Schwarz, :math:`|R_{jl}| \le |\rho_{jl}|^{4}\sqrt{T_jT_l}` with
:math:`T_j = V_j - \sum_{k\le3}v_j^ke_{jk}^2/k!` (:func:`mehler_tail_bound`). LeakyReLU instead
carries the ReLU's corrected off-diagonal form: with :math:`\psi = \alpha + (1-\alpha)\Phi(\mu)`,
:math:`C_{jl} = \Sigma_{jl}\psi_j\psi_l + (1-\alpha)^2\sigma_j\sigma_lK(\rho_{jl}, \mu_j, \mu_l)`,
the ReLU kernel with a gain (Stein's lemma makes the two mixed terms exact).

**Slopes.** :math:`E[f'(a)]` for skip connections (Stein's lemma), from the same engine.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from . import policy
from ._mehler import mehler_cov, parseval_sum
from ._quadrature import (
    DEFAULT_NODES,
    Kernel,
    _Scratch,
    _Take,
    constant,
    gauss_hermite,
    smooth_moments,
)
from ._relu import floors
from ._relu_cov import relu_cov
from .activations import relu_diag, relu_slope
from .special import flush, normal_cdf, normal_pdf, tail_argument

__all__ = [
    "DEFAULT_NODES",
    "GELU_CLOSED_NODES",
    "GELU_FEW_NODES",
    "GELU_KERNEL",
    "GELU_RULES",
    "GELU_TANH_KERNEL",
    "SIGMOID_KERNEL",
    "SILU_KERNEL",
    "SOFTPLUS_KERNEL",
    "GeluRule",
    "gelu_closed_diag",
    "gelu_closed_full",
    "gelu_closed_slope",
    "gelu_diag",
    "gelu_full",
    "gelu_slope",
    "gelu_slope_diag",
    "gelu_slope_full",
    "gelu_tanh_diag",
    "gelu_tanh_full",
    "gelu_tanh_slope",
    "leaky_relu_diag",
    "leaky_relu_full",
    "leaky_relu_slope",
    "mehler_cov",
    "mehler_tail_bound",
    "quadrature_rule",
    "sigmoid_diag",
    "sigmoid_full",
    "sigmoid_slope",
    "silu_diag",
    "silu_full",
    "silu_slope",
    "smooth_moments",
    "softplus_diag",
    "softplus_full",
    "softplus_slope",
    "tanh_diag",
    "tanh_full",
    "tanh_slope",
]

_Pair = tuple[Tensor, Tensor]
_Scale = tuple[float, float, float]
_SQRT_HALF = math.sqrt(0.5)
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def quadrature_rule(num_nodes: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Gauss–Hermite nodes and weights (probabilists', weights summing to one), cached.

    Modules call it at construction so that tracing (``torch.export``) finds the rule cached.
    """
    return gauss_hermite(int(num_nodes))


# ------------------------------------------------------------------ derivatives (kernels)
def _sigmoid_derivs_of(y: Tensor, k: int, take: _Take) -> list[Tensor]:
    r""":math:`\sigma^{(j)}`, :math:`j \le k \le 6`, as polynomials in :math:`y = \sigma(x)`.

    With :math:`d = y(1-y) = \sigma'` and :math:`t = 1 - 2y` (:math:`t^2 = 1 - 4d`):
    :math:`\sigma'' = dt`, :math:`\sigma''' = d(1-6d)`, :math:`\sigma^{(4)} = dt(1-12d)`,
    :math:`\sigma^{(5)} = d(1-30d+120d^2)`, :math:`\sigma^{(6)} = dt(1-60d+360d^2)`.
    """
    out = [y]
    if k >= 1:
        d = torch.addcmul(y, y, y, value=-1, out=take())
        out.append(d)
    if k >= 2:
        dt = torch.mul(y, -2, out=take()).add_(1).mul_(d)
        out.append(dt)
    if k >= 3:
        out.append(torch.mul(d, -6, out=take()).add_(1).mul_(d))
    if k >= 4:
        out.append(torch.mul(d, -12, out=take()).add_(1).mul_(dt))
    if k >= 5:
        out.append(torch.mul(d, 120, out=take()).sub_(30).mul_(d).add_(1).mul_(d))
    if k >= 6:
        out.append(torch.mul(d, 360, out=take()).sub_(60).mul_(d).add_(1).mul_(dt))
    return out


def _sigmoid_derivs(x: Tensor, k: int, take: _Take) -> list[Tensor]:
    return _sigmoid_derivs_of(torch.sigmoid(x, out=take()), k, take)


def _times_x(x: Tensor, g: list[Tensor]) -> list[Tensor]:
    r"""Derivatives of :math:`x\,g(x)`, :math:`x g^{(j)} + j g^{(j-1)}`, in place on ``g``."""
    for j in range(len(g) - 1, 0, -1):  # descending: g[j - 1] is still g's own
        g[j].mul_(x).add_(g[j - 1], alpha=j)
    g[0].mul_(x)
    return g


def _silu_derivs(x: Tensor, k: int, take: _Take) -> list[Tensor]:
    return _times_x(x, _sigmoid_derivs(x, k, take))


def _softplus_derivs(x: Tensor, k: int, take: _Take) -> list[Tensor]:
    # log(1 + e^-|x|) + max(x, 0): exact in both tails
    value = torch.abs(x, out=take()).neg_().exp_().log1p_()
    value.add_(torch.clamp(x, min=0, out=take()))
    return [value, *_sigmoid_derivs(x, k - 1, take)] if k else [value]


def _gelu_derivs(x: Tensor, k: int, take: _Take) -> list[Tensor]:
    r""":math:`\Phi^{(i)} = (-1)^{i-1}\mathrm{He}_{i-1}(x)\phi(x)`, then :math:`x\Phi` (:func:`_times_x`).

    :math:`\Phi` and :math:`\phi` with clamped arguments (no underflowing ``erfc``/``exp``);
    the engine flushes its outputs.
    """
    c = tail_argument(x.dtype)
    cdf = torch.mul(x, -_SQRT_HALF, out=take()).clamp_(-c, c).erfc_().mul_(0.5)
    pdf = torch.mul(x, x, out=take()).mul_(-0.5).clamp_(min=-c * c).exp_().mul_(_INV_SQRT_2PI)
    derivs = [cdf, pdf][: k + 1]
    he_prev: Tensor | None = None
    he = x  # He_1
    for i in range(2, k + 1):  # Phi^(i) = (-1)^(i-1) He_{i-1} phi
        derivs.append(torch.mul(he, pdf, out=take()).mul_((-1) ** (i - 1)))
        if i < k:  # He_i = x He_{i-1} - (i-1) He_{i-2}
            nxt = torch.mul(x, he, out=take())
            he_prev, he = he, nxt.sub_(i - 1) if he_prev is None else nxt.sub_(he_prev, alpha=i - 1)
    return _times_x(x, derivs)


_K_TANH = math.sqrt(2.0 / math.pi)
_C_TANH = 0.044715


def _compose(outer: list[Tensor], inner: list[Tensor], k: int) -> list[Tensor]:
    r"""Derivatives of :math:`g(w(x))` (Faà di Bruno with partial Bell polynomials).

    ``outer[j]`` is :math:`g^{(j)}(w)`, ``inner[i]`` is :math:`w^{(i+1)}`;
    :math:`(g\circ w)^{(n)} = \sum_k g^{(k)}(w) B_{n,k}(w', w'', \ldots)` with
    :math:`B_{n,k} = \sum_i \binom{n-1}{i-1} w^{(i)} B_{n-i,k-1}`.
    """
    bell: dict[tuple[int, int], Tensor | float] = {(0, 0): 1.0}
    out = [outer[0]]
    for n in range(1, k + 1):
        total: Tensor | float = 0.0
        for j in range(1, n + 1):
            b: Tensor | float = 0.0
            for i in range(1, min(n - j + 1, len(inner)) + 1):
                prev = bell.get((n - i, j - 1))
                if prev is not None:
                    b = b + math.comb(n - 1, i - 1) * inner[i - 1] * prev
            if not isinstance(b, float):
                bell[(n, j)] = b
                total = total + outer[j] * b
        out.append(total if isinstance(total, Tensor) else torch.zeros_like(outer[0]))
    return out


def _gelu_tanh_derivs(x: Tensor, k: int, take: _Take) -> list[Tensor]:
    r""":math:`x\,\sigma(w)`, :math:`w = 2\sqrt{2/\pi}(x + 0.044715x^3)` (torch's tanh form)."""
    x = x.clamp_(min=-50.0)  # beyond it every derivative is 0 to any precision (w^(j) finite)
    a, c = 2 * _K_TANH, 2 * _K_TANH * _C_TANH
    x2 = torch.mul(x, x, out=take())
    w = torch.mul(x2, c, out=take()).add_(a).mul_(x)
    g = _sigmoid_derivs(w, k, take)
    if k >= 1:
        w1 = x2.mul_(3 * c).add_(a)  # w'
        if k <= 2:  # g' = s' w', g'' = s'' w'^2 + s' w'' (the diag path, in place)
            if k == 2:
                g[2].mul_(w1).mul_(w1).addcmul_(g[1], torch.mul(x, 6 * c, out=take()))
            g[1].mul_(w1)
        else:
            g = _compose(g, [w1, x * (6 * c), torch.full_like(x, 6 * c)], k)
    return _times_x(x, g)


# Node counts and switch points: the fewest that keep both rules within 1e-5 relative of
# quadrature (1e-4 at the switch; scan in docs/moments.md). Sigmoid-like tails (e^-|x|) are easy
# for Gauss–Hermite; GELU's Gaussian tails need more nodes and an earlier switch.
_ODD, _PLUS_X = (1.0, 0.0, -1.0), (0.0, 1.0, 1.0)
_GELU_BUCKETS = ((0.3, 8), (0.5, 10), (0.8, 16), (1.2, 24))
SIGMOID_KERNEL = Kernel(
    "sigmoid", _sigmoid_derivs, _ODD, (1.0, 0.0), ((0.3, 6), (0.7, 10), (1.5, 16)), 16
)
SILU_KERNEL = Kernel(
    "silu", _silu_derivs, _PLUS_X, (0.0, 1.0), ((0.3, 6), (0.7, 10), (1.2, 16)), 24
)
SOFTPLUS_KERNEL = Kernel(
    "softplus", _softplus_derivs, _PLUS_X, (0.0, 1.0), ((0.3, 6), (0.7, 8), (1.5, 16)), 16
)
GELU_KERNEL = Kernel("gelu", _gelu_derivs, _PLUS_X, (0.0, 1.0), _GELU_BUCKETS, 32)
GELU_TANH_KERNEL = Kernel("gelu_tanh", _gelu_tanh_derivs, _PLUS_X, (0.0, 1.0), _GELU_BUCKETS, 32)


# ------------------------------------------------------------------ diag / full / slope
_Nodes = int | None


def _diag(kernel: Kernel, scale: _Scale, mean: Tensor, var: Tensor, num_nodes: _Nodes) -> _Pair:
    out = smooth_moments(kernel, mean, var, 0, num_nodes, scale)
    return out[0], out[1]


def _full(kernel: Kernel, scale: _Scale, mean: Tensor, cov: Tensor, num_nodes: _Nodes) -> _Pair:
    var = cov.diagonal(dim1=-2, dim2=-1)
    out_mean, out_var, *derivs = smooth_moments(kernel, mean, var, 3, num_nodes, scale)
    return out_mean, mehler_cov(cov, torch.stack(derivs, -1), out_var)


def _slope(kernel: Kernel, scale: _Scale, mean: Tensor, var: Tensor, num_nodes: _Nodes) -> Tensor:
    return smooth_moments(kernel, mean, var, 1, num_nodes, scale)[2]


def _family(
    kernel: Kernel, scale: _Scale, prefix: str, name: str
) -> tuple[Callable[..., Any], ...]:
    switch = kernel.switch / scale[0]
    how = (
        f"Gauss–Hermite (sd <= {switch:g}) or asymptote plus Gauss–Laguerre quadrature "
        "(:mod:`lightning_dvi.moments._quadrature`)"
    )

    def diag(mean: Tensor, var: Tensor, num_nodes: _Nodes = None) -> _Pair:
        return _diag(kernel, scale, mean, var, num_nodes)

    def full(mean: Tensor, cov: Tensor, num_nodes: _Nodes = None) -> _Pair:
        return _full(kernel, scale, mean, cov, num_nodes)

    def slope(mean: Tensor, var: Tensor, num_nodes: _Nodes = None) -> Tensor:
        return _slope(kernel, scale, mean, var, num_nodes)

    diag.__doc__ = f"Mean and variance of {name}(a), a ~ N(mean, var), by {how}."
    full.__doc__ = (
        f"Mean and covariance of {name}(a): {how} on the diagonal, three-term Mehler series "
        "off it (:func:`mehler_cov`)."
    )
    slope.__doc__ = f"E[{name}'(a)] by {how} (skip connections)."
    for f, suffix in ((diag, "diag"), (full, "full"), (slope, "slope")):
        f.__name__ = f.__qualname__ = f"{prefix}_{suffix}"
    return diag, full, slope


_ID: _Scale = (1.0, 1.0, 0.0)
sigmoid_diag, sigmoid_full, sigmoid_slope = _family(SIGMOID_KERNEL, _ID, "sigmoid", "sigmoid")
tanh_diag, tanh_full, tanh_slope = _family(SIGMOID_KERNEL, (2.0, 2.0, -1.0), "tanh", "tanh")
silu_diag, silu_full, silu_slope = _family(SILU_KERNEL, _ID, "silu", "silu")
gelu_diag, gelu_full, gelu_slope = _family(GELU_KERNEL, _ID, "gelu", "gelu")
gelu_tanh_diag, gelu_tanh_full, gelu_tanh_slope = _family(
    GELU_TANH_KERNEL, _ID, "gelu_tanh", "gelu (tanh approximation)"
)


def _softplus_scale(beta: float) -> _Scale:
    beta = float(beta)
    if not (math.isfinite(beta) and beta > 0):
        raise ValueError(f"softplus beta must be a positive finite number, got {beta!r}")
    return (beta, 1.0 / beta, 0.0)


def softplus_diag(mean: Tensor, var: Tensor, beta: float = 1.0, num_nodes: _Nodes = None) -> _Pair:
    r"""Mean and variance of :math:`\log(1 + e^{\beta a})/\beta`, :math:`a \sim \mathcal N(m, v)`.

    The engine of :mod:`._quadrature` with :math:`f' = \sigma`; ``beta`` scales the input and
    the output (``torch.nn.Softplus``'s ``threshold`` only switches its numerics, not the
    function, and has no counterpart here).
    """
    return _diag(SOFTPLUS_KERNEL, _softplus_scale(beta), mean, var, num_nodes)


def softplus_full(mean: Tensor, cov: Tensor, beta: float = 1.0, num_nodes: _Nodes = None) -> _Pair:
    """Mean and covariance of softplus: as :func:`softplus_diag`, Mehler series off the diagonal."""
    return _full(SOFTPLUS_KERNEL, _softplus_scale(beta), mean, cov, num_nodes)


def softplus_slope(
    mean: Tensor, var: Tensor, beta: float = 1.0, num_nodes: _Nodes = None
) -> Tensor:
    r""":math:`E[\sigma(\beta a)]`, the slope of softplus (skip connections)."""
    return _slope(SOFTPLUS_KERNEL, _softplus_scale(beta), mean, var, num_nodes)


def mehler_tail_bound(derivs: Tensor, out_var: Tensor, cov: Tensor) -> Tensor:
    r"""Bound :math:`|\rho_{jl}|^{4}\sqrt{T_jT_l}` on the truncation error of :func:`mehler_cov`.

    Args:
        derivs: :math:`e_{jk} = E f^{(k)}(a_j)`, ``[..., D, 3]``.
        out_var: the output variances :math:`V_j`.
        cov: the input covariance.
    """
    var_in = cov.diagonal(dim1=-2, dim2=-1)
    tail = (out_var - parseval_sum(var_in, derivs)).clamp_min(0).sqrt()
    sd = var_in.clamp_min(floors(cov.dtype)[0]).sqrt()
    rho = (cov / (sd[..., :, None] * sd[..., None, :])).clamp(-1, 1)
    return rho.abs() ** 4 * tail[..., :, None] * tail[..., None, :]


# ------------------------------------------------------------------------------- LeakyReLU
def leaky_relu_diag(mean: Tensor, var: Tensor, negative_slope: float = 0.01) -> _Pair:
    r"""Exact mean and variance of :math:`\alpha a + (1-\alpha)\max(0, a)`.

    .. math::
        E[h] = \alpha m + (1-\alpha)E[r],\quad
        \operatorname{Var}(h) = \alpha^2 v + 2\alpha(1-\alpha)v\Phi(\mu) + (1-\alpha)^2\operatorname{Var}(r),

    with :math:`r = \max(0, a)` (:func:`~lightning_dvi.moments.relu_diag`).
    """
    a = float(negative_slope)
    r_mean, r_var = relu_diag(mean, var)
    cdf = relu_slope(mean, var)
    out_var = a * a * var + 2 * a * (1 - a) * var * cdf + (1 - a) ** 2 * r_var
    return flush(a * mean + (1 - a) * r_mean), flush(out_var.clamp_min(0))


def leaky_relu_slope(mean: Tensor, var: Tensor, negative_slope: float = 0.01) -> Tensor:
    r""":math:`E[f'(a)] = \alpha + (1-\alpha)\Phi(\mu)`."""
    a = float(negative_slope)
    return a + (1 - a) * relu_slope(mean, var)


def leaky_relu_full(mean: Tensor, cov: Tensor, negative_slope: float = 0.01) -> _Pair:
    r"""Mean and covariance of LeakyReLU; diagonal exact, off-diagonal through the ReLU form.

    .. math::
        \operatorname{Cov}(h_j, h_l) = \Sigma_{jl}\psi_j\psi_l
            + (1-\alpha)^2\sigma_j\sigma_l K(\rho_{jl}, \mu_j, \mu_l),\qquad
        \psi = \alpha + (1-\alpha)\Phi(\mu),

    (expand :math:`h = \alpha a + (1-\alpha)r` and use
    :math:`\operatorname{Cov}(a_j, r_l) = \Sigma_{jl}\Phi_l`, Stein), evaluated by the ReLU
    covariance kernel (:mod:`._relu_cov`) with :math:`\psi` for :math:`\Phi` and the gain
    :math:`(1-\alpha)^2` on :math:`K`, clamped to Cauchy–Schwarz with the exact variances.
    """
    a = float(negative_slope)
    var = cov.diagonal(dim1=-2, dim2=-1)
    out_mean, out_var = leaky_relu_diag(mean, var, a)
    lead = torch.broadcast_shapes(mean.shape[:-1], cov.shape[:-2])
    mean, cov = mean.expand(*lead, mean.shape[-1]), cov.expand(*lead, *cov.shape[-2:])
    var = cov.diagonal(dim1=-2, dim2=-1)
    sd = var.clamp_min(floors(var.dtype)[0]).sqrt()
    mu = (mean / sd).clamp(-1e3, 1e3)
    psi = a + (1 - a) * normal_cdf(mu)
    return out_mean, relu_cov(cov, sd, mu, psi, out_var.expand(*lead, -1), gain=(1 - a) ** 2)


# ------------------------------------------------------------------ GELU in closed form
GELU_RULES = ("quadrature", "closed", "slope")
"""Moment rules of the exact GELU: the quadrature engine (the oracle), :func:`gelu_closed_diag`,
or :func:`gelu_slope_diag` (the exact mean, the variance's term linear in the input's)."""
GeluRule = Literal["quadrature", "closed", "slope"]
GELU_CLOSED_NODES = 10
"""Gauss–Legendre nodes of the one integral in :func:`gelu_closed_diag` (Owen's T difference)."""


@functools.cache
def _legendre_unit(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Gauss–Legendre nodes and weights on :math:`[0, 1]` (weights summing to one), as floats."""
    x, w = np.polynomial.legendre.leggauss(n)
    return tuple(float(v) for v in (x + 1) / 2), tuple(float(v) for v in w / 2)


_LEGENDRE = _legendre_unit(GELU_CLOSED_NODES)  # built at import: tracing finds floats only
GELU_FEW_NODES = 5
"""Gauss–Legendre nodes of :func:`_gelu_phi2_excess` where every element is in the narrow case."""
_LEGENDRE_FEW = _legendre_unit(GELU_FEW_NODES)
#: The narrow case: interval width :math:`1 - a` and integrand decay :math:`R` up to these,
#: where 5 nodes are within 1e-12 relative of the integral (7e-13 largest on a grid of
#: :math:`|h| \le 12`, :math:`v = 10^{-8} \dots 10^4` against 60 nodes; 10 nodes: 2e-13).
FEW_NODES_WIDTH, FEW_NODES_DECAY = 0.2, 1.0


def _gelu_closed_terms(mean: Tensor, var: Tensor) -> tuple[Tensor, ...]:
    r"""The shared pieces of :func:`gelu_closed_diag` and :func:`gelu_closed_slope`.

    Returns :math:`t = 1+v`, :math:`r = \sqrt t`, :math:`h = m/r`, :math:`\Phi(h)`,
    :math:`\phi(h)`.
    """
    t = var + 1.0
    r = t.sqrt()
    h = mean / r
    return t, r, h, normal_cdf(h), normal_pdf(h)


def gelu_closed_slope(mean: Tensor, var: Tensor) -> Tensor:
    r""":math:`E[\mathrm{GELU}'(a)]`, :math:`a \sim \mathcal N(m, v)`, in closed form.

    :math:`\mathrm{GELU}'(x) = \Phi(x) + x\phi(x)`, and a Gaussian density times
    :math:`\phi` is a Gaussian, :math:`\phi(x)\mathcal N(x; m, v) = \frac{\phi(h)}{r}
    \mathcal N(x; m/t, v/t)`, so

    .. math::
        E[\mathrm{GELU}'(a)] = \Phi(h) + \frac{h\,\phi(h)}{t},\qquad
        t = 1 + v,\ r = \sqrt t,\ h = m/r.

    By Stein's lemma this is also :math:`\operatorname{Cov}(a, \mathrm{GELU}(a))/v`, the
    factor a skip connection's cross-covariance takes through the activation.
    """
    t, _, h, cdf, pdf = _gelu_closed_terms(mean, var.clamp_min(0))
    return flush(cdf + h * pdf / t)


def gelu_slope_diag(mean: Tensor, var: Tensor) -> _Pair:
    r"""GELU's exact mean and the part of its variance linear in the input variance.

    With :math:`t = 1+v`, :math:`r = \sqrt t`, :math:`h = m/r` and
    :math:`e_1 = E[\mathrm{GELU}'(a)] = \Phi(h) + h\phi(h)/t` (:func:`gelu_closed_slope`):

    .. math::
        E[\mathrm{GELU}(a)] = m\,\Phi(h) + \frac{v}{r}\,\phi(h)\ \text{(exact)},\qquad
        \operatorname{Var} \approx e_1^2\,v.

    :math:`e_1^2 v = \operatorname{Cov}(a, \mathrm{GELU}(a))^2/v` (Stein's lemma) is the
    variance of the best linear fit of :math:`\mathrm{GELU}(a)` in :math:`a`: the first term of
    the Hermite expansion :math:`\operatorname{Var} = \sum_{k\ge1} e_k^2 v^k/k!`,
    :math:`e_k = E[\mathrm{GELU}^{(k)}(a)]`, so it never exceeds the exact variance and falls
    short of it by :math:`\sum_{k\ge2} e_k^2 v^k/k!`, which is :math:`O(v^2)`
    (:math:`|e_2| \le 2\phi(0) < 0.8`). A cheap rule for a posterior's small input variances,
    in the spirit of SUQ's linearised activations (:math:`\mathrm{GELU}'(m)^2 v`), but with
    the mean and the slope taken over the Gaussian rather than at its mean. Measured against
    the closed form and Monte Carlo in ``tests/test_gelu_closed.py``: within 1e-3 absolute of
    the exact variance for :math:`v \le 0.05`, relative error growing like :math:`v`
    (``docs/transformers.md``).
    """
    if _in_buffers(mean, var):
        return _gelu_slope_diag_buffers(mean, var)
    v = var.clamp_min(0)
    t, r, h, cdf, pdf = _gelu_closed_terms(mean, v)
    slope = cdf + h * pdf / t
    return flush(mean * cdf + v / r * pdf), flush(slope * slope * v)


def _gelu_slope_diag_buffers(mean: Tensor, var: Tensor) -> _Pair:
    """:func:`gelu_slope_diag`'s formula with in-place operations (no autograd, eager, CPU).

    The same operations (so the same values to rounding, up to the flushes of the
    intermediate normal CDF and density below :func:`~.special.tail_cutoff`, which only the
    outputs get here), in seven ``[N]`` arrays instead of about twenty, some fused
    (``addcmul``, ``addcdiv``).
    """
    c = tail_argument(mean.dtype)
    v = var.clamp_min(0)
    t = v + 1.0
    r = t.sqrt()
    h = mean / r
    cdf = torch.mul(h, -_SQRT_HALF).clamp_(-c, c).erfc_().mul_(0.5)
    low = -c * c - 1.0  # as normal_pdf: exp of it is below the cutoff
    pdf = torch.addcmul(h.new_full((), -_LOG_SQRT_2PI), h, h, value=-0.5)
    pdf = pdf.clamp_(min=low).exp_()
    out_mean = torch.div(v, r).mul_(pdf).addcmul_(mean, cdf)
    slope = torch.addcdiv(cdf, h.mul_(pdf), t)
    return flush(out_mean), flush(slope.mul_(slope).mul_(v))


def gelu_slope_full(mean: Tensor, cov: Tensor) -> _Pair:
    r""":func:`gelu_slope_diag` with a full covariance: :math:`e_{1,i}\,C_{ij}\,e_{1,j}`.

    The first Mehler term alone (:func:`gelu_closed_full` keeps three and the exact
    diagonal); its diagonal is :func:`gelu_slope_diag`'s variance, and it is PSD whenever
    :math:`C` is.
    """
    var = cov.diagonal(dim1=-2, dim2=-1).clamp_min(0)
    t, r, h, cdf, pdf = _gelu_closed_terms(mean, var)
    slope = flush(cdf + h * pdf / t)
    out_cov = slope.unsqueeze(-1) * cov * slope.unsqueeze(-2)
    return flush(mean * cdf + var / r * pdf), flush(out_cov)


def _gelu_phi2_excess(h: Tensor, v: Tensor, q: Tensor, scratch: _Scratch | None = None) -> Tensor:
    r""":math:`\Phi_2(h, h; \rho) - \Phi(h)^2`, :math:`\rho = v/(1+v)`, by Gauss–Legendre.

    With :math:`a = 1/q`, :math:`q = \sqrt{1 + 2v}` (so :math:`a^2 = (1-\rho)/(1+\rho)`),
    :math:`\Phi_2(h, h; \rho) = \Phi(h) - 2T(h, a)` and :math:`T(h, 1) = \Phi(h)\Phi(-h)/2`
    (Owen's T function) give

    .. math::
        \Phi_2(h, h; \rho) - \Phi(h)^2 = 2\,[T(h, 1) - T(h, a)]
        = \frac1\pi \int_a^1 \frac{e^{-h^2(1+x^2)/2}}{1+x^2}\,dx,

    a positive integrand on an interval of length :math:`1 - a = 2v/(q(1+q))` (no
    cancellation as :math:`v \to 0`), by the :data:`GELU_CLOSED_NODES`-point Gauss–Legendre
    rule. Its integrand falls by :math:`e^{-R}`, :math:`R = h^2(1-a^2)/2 \le 0.172\,m^2`,
    across the interval: the rule's relative error is below :math:`10^{-7}` for
    :math:`R \le 25` (every :math:`v` at :math:`|m| \le 12`; measured, ``docs/posthoc.md``);
    where :math:`R` is larger the term itself is below :math:`(1-a)e^{-R}/\pi`, as
    :math:`h^2(1+a^2)/2 = m^2/(1+2v) \ge R`.

    In reused buffers (``scratch``: eager, no autograd, the predictive's path) the rule drops
    to :data:`GELU_FEW_NODES` nodes when every element has :math:`1 - a \le 0.2` and
    :math:`R = h^2 v/q^2 \le 1` (:data:`FEW_NODES_WIDTH`, :data:`FEW_NODES_DECAY`: a
    posterior's small input variances), where the integrand is smooth and nearly flat: within
    1e-12 relative there (``tests/test_gelu_closed.py`` against scipy's Owen's T). The check
    is one read of two maxima; differentiated or traced calls keep the full rule.
    """
    width = 2 * v / (q * (q + 1))  # 1 - a
    nodes, weights = _LEGENDRE
    if scratch is not None and h.numel() and _narrow(h, v, q, width):
        nodes, weights = _LEGENDRE_FEW
    n = len(nodes)
    xi = constant(nodes, h.dtype, h.device).view(n, *(1,) * h.dim())
    wi = constant(weights, h.dtype, h.device).view_as(xi)
    u = (
        xi * width
        if scratch is None
        else torch.mul(xi, width, out=scratch.take(n).view(n, *width.shape))
    )
    # [n, ...]: x_i = 1 - u_i, so 1 + x_i^2 = (u_i - 2) u_i + 2
    half_h2 = h * h * -0.5
    # clamped where exp would leave the normal range (the result is flushed anyway)
    c2 = tail_argument(h.dtype) ** 2 + 10.0
    if torch.is_grad_enabled() and any(t.requires_grad for t in (h, v, q)):
        x2 = (u - 2) * u + 2
        values = torch.exp((x2 * half_h2).clamp(min=-c2)) / x2 * wi
    else:  # the same in place: two [n, ...] buffers, not six (the predictive's path)
        x2 = u - 2 if scratch is None else torch.sub(u, 2, out=scratch.take(n).view_as(u))
        x2 = x2.mul_(u).add_(2)
        values = u.copy_(x2).mul_(half_h2).clamp_(min=-c2).exp_().div_(x2).mul_(wi)
    return width * values.sum(0) / math.pi


def _narrow(h: Tensor, v: Tensor, q: Tensor, width: Tensor) -> bool:
    """Whether every element is in :func:`_gelu_phi2_excess`'s narrow case (a host read)."""
    if float(width.max()) > FEW_NODES_WIDTH:
        return False
    return float((h * h * v / (q * q)).max()) <= FEW_NODES_DECAY


def gelu_closed_diag(mean: Tensor, var: Tensor) -> _Pair:
    r"""Mean and variance of :math:`\mathrm{GELU}(a) = a\Phi(a)`, :math:`a \sim \mathcal N(m, v)`.

    Closed form, but for one one-dimensional integral. With :math:`t = 1 + v`,
    :math:`r = \sqrt t`, :math:`h = m/r`, :math:`q = \sqrt{1+2v}`, :math:`k = h/q`:

    .. math::
        E[\mathrm{GELU}(a)] = m\,\Phi(h) + \frac{v}{r}\,\phi(h).

    For the second moment write :math:`g = \Phi^2`; Stein's lemma twice gives
    :math:`E[a^2 g(a)] = (m^2+v)E g + 2mv\,E g' + v^2 E g''` with
    :math:`E g = \Phi_2(h, h; \rho)` (:math:`\rho = v/t`, the bivariate normal CDF),
    :math:`E g' = 2E[\Phi\phi] = 2\frac{\phi(h)}{r}\Phi(k)`,
    :math:`E g'' = 2E[\phi^2] - 2E[a\Phi\phi]` with
    :math:`E[\phi(a)^2] = e^{-m^2/q^2}/(2\pi q)` and
    :math:`E[a\Phi(a)\phi(a)] = \frac{\phi(h)}{r}\bigl(\frac mt\Phi(k) + \frac{v}{rq}\phi(k)\bigr)`
    (a Gaussian times :math:`\phi` is a Gaussian). Subtracting the square of the mean
    analytically (the :math:`m^2\Phi(h)^2` terms cancel exactly) leaves

    .. math::
        \operatorname{Var} = m^2 C + v\,(\Phi(h)^2 + C)
            + \frac{2mv\,\phi(h)}{r}\,(2\Phi(k) - \Phi(h))
            + v^2\Bigl(2E[\phi^2] - 2E[a\Phi\phi] - \frac{\phi(h)^2}{t}\Bigr),

    with :math:`C = \Phi_2(h,h;\rho) - \Phi(h)^2 \ge 0` from :func:`_gelu_phi2_excess`. Every
    term is :math:`O(v)`: no square root of :math:`v`, no difference of two numbers near
    :math:`m^2`, and exactly 0 at :math:`v = 0`. Differentiable by autograd (the rule's
    nodes are constants). Relative error against adaptive quadrature below :math:`10^{-7}`
    in float64 for :math:`|m| \le 12`, any :math:`v` (``docs/posthoc.md``).
    """
    if _in_buffers(mean, var):
        return _gelu_closed_diag_buffers(mean, var)
    v = var.clamp_min(0)
    t, r, h, cdf_h, pdf_h = _gelu_closed_terms(mean, v)
    q = (2 * v + 1).sqrt()
    k = h / q
    cdf_k, pdf_k = normal_cdf(k), normal_pdf(k)
    excess = _gelu_phi2_excess(h, v, q)
    out_mean = mean * cdf_h + v / r * pdf_h
    c = tail_argument(mean.dtype)
    e_phi2 = (mean * mean / (q * q)).neg().clamp_min(-c * c).exp() / (2 * math.pi * q)
    pdf_r = pdf_h / r
    e_a_cdf_pdf = pdf_r * (mean / t * cdf_k + v / (r * q) * pdf_k)
    out_var = (
        mean * mean * excess
        + v * (cdf_h * cdf_h + excess)
        + 2 * mean * v * pdf_r * (2 * cdf_k - cdf_h)
        + v * v * (2 * e_phi2 - 2 * e_a_cdf_pdf - pdf_h * pdf_h / t)
    )
    return flush(out_mean), flush(out_var.clamp_min(0))


def _in_buffers(mean: Tensor, var: Tensor) -> bool:
    """Whether :func:`gelu_closed_diag` may run in reused buffers: no autograd, eager, CPU."""
    if torch.is_grad_enabled() and (mean.requires_grad or var.requires_grad):
        return False
    tracing = policy.tracing() or torch.compiler.is_exporting()
    return not tracing and mean.device.type == "cpu" and mean.shape == var.shape


def _gelu_closed_diag_buffers(mean: Tensor, var: Tensor) -> _Pair:
    """:func:`gelu_closed_diag`'s formula, in place in one reused scratch array.

    The same operations in the same order (so the same values, up to the flushes of the
    intermediate normal CDFs and densities below :func:`~.special.tail_cutoff`, which only
    the outputs get here); some fifty ``[N]`` temporaries of 128 KiB each would otherwise
    be page-faulted in afresh on every call (``_quadrature.POOL_LIMIT``), more than the
    arithmetic costs.
    """
    shape, m = mean.shape, mean.reshape(-1)
    c = tail_argument(m.dtype)
    scratch = _Scratch(m, m.numel())
    b = scratch.take(13)
    v = torch.clamp(var.reshape(-1), min=0, out=b[0])
    t = torch.add(v, 1.0, out=b[1])
    r = torch.sqrt(t, out=b[2])
    h = torch.div(m, r, out=b[3])
    q = torch.mul(v, 2, out=b[4]).add_(1).sqrt_()
    k = torch.div(h, q, out=b[5])

    def cdf(x: Tensor, out: Tensor) -> Tensor:
        return torch.mul(x, -_SQRT_HALF, out=out).clamp_(-c, c).erfc_().mul_(0.5)

    def pdf(x: Tensor, out: Tensor) -> Tensor:
        low = -c * c - 1.0  # as normal_pdf: exp of it is below the cutoff
        return torch.mul(x, x, out=out).mul_(-0.5).sub_(_LOG_SQRT_2PI).clamp_(min=low).exp_()

    cdf_h, pdf_h = cdf(h, b[6]), pdf(h, b[7])
    cdf_k, pdf_k = cdf(k, b[8]), pdf(k, b[9])
    excess = _gelu_phi2_excess(h, v, q, scratch)
    tmp = torch.div(v, r, out=b[10]).mul_(pdf_h)
    out_mean = torch.mul(m, cdf_h).add_(tmp)
    e_phi2 = torch.mul(q, q, out=b[11])
    e_phi2 = torch.mul(m, m, out=b[10]).div_(e_phi2).neg_().clamp_(min=-c * c).exp_()
    e_phi2 = e_phi2.div_(torch.mul(q, 2 * math.pi, out=b[11]))
    pdf_r = torch.div(pdf_h, r, out=b[11])
    # e_a_cdf_pdf = pdf_r (m / t cdf_k + v / (r q) pdf_k), into b[12]
    e_acp = torch.div(m, t, out=b[12]).mul_(cdf_k)
    rq = torch.mul(r, q, out=b[5])  # k is no longer needed
    e_acp = e_acp.add_(torch.div(v, rq, out=b[5]).mul_(pdf_k)).mul_(pdf_r)
    out_var = torch.mul(m, m).mul_(excess)
    out_var.add_(torch.mul(cdf_h, cdf_h, out=b[5]).add_(excess).mul_(v))
    two = torch.mul(cdf_k, 2, out=b[5]).sub_(cdf_h).mul_(pdf_r).mul_(m).mul_(v)
    out_var.add_(two, alpha=2)
    last = torch.mul(pdf_h, pdf_h, out=b[5]).div_(t).neg_().add_(e_phi2, alpha=2)
    out_var.add_(last.sub_(e_acp, alpha=2).mul_(v).mul_(v))
    return flush(out_mean).view(shape), flush(out_var.clamp_min_(0)).view(shape)


def gelu_closed_full(mean: Tensor, cov: Tensor) -> _Pair:
    r"""Mean and covariance of GELU: :func:`gelu_closed_diag` on the diagonal, Mehler off it.

    The three Mehler coefficients are closed forms too: with
    :math:`\mathrm{GELU}'' = (2 - x^2)\phi`, :math:`\mathrm{GELU}''' = (x^3 - 4x)\phi` and
    :math:`\phi(x)\mathcal N(x; m, v) = \frac{\phi(h)}{r}\mathcal N(x; \mu', v')`,
    :math:`\mu' = m/t`, :math:`v' = v/t`:
    :math:`e_2 = \frac{\phi(h)}{r}(2 - \mu'^2 - v')`,
    :math:`e_3 = \frac{\phi(h)}{r}(\mu'^3 + 3\mu'v' - 4\mu')`, and :math:`e_1` from
    :func:`gelu_closed_slope` (:func:`mehler_cov`).
    """
    var = cov.diagonal(dim1=-2, dim2=-1).clamp_min(0)
    out_mean, out_var = gelu_closed_diag(mean, var)
    t, r, h, cdf, pdf = _gelu_closed_terms(mean, var)
    mu, vp, pdf_r = mean / t, var / t, pdf / r
    e1 = cdf + h * pdf / t
    e2 = pdf_r * (2 - mu * mu - vp)
    e3 = pdf_r * mu * (mu * mu + 3 * vp - 4)
    derivs = torch.stack([flush(e1), flush(e2), flush(e3)], -1)
    return out_mean, mehler_cov(cov, derivs, out_var)
