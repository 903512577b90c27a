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

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._mehler import mehler_cov, parseval_sum
from ._quadrature import DEFAULT_NODES, Kernel, _Take, gauss_hermite, smooth_moments
from ._relu import floors
from ._relu_cov import relu_cov
from .activations import relu_diag, relu_slope
from .special import flush, normal_cdf, tail_argument

__all__ = [
    "DEFAULT_NODES",
    "GELU_KERNEL",
    "GELU_TANH_KERNEL",
    "SIGMOID_KERNEL",
    "SILU_KERNEL",
    "SOFTPLUS_KERNEL",
    "gelu_diag",
    "gelu_full",
    "gelu_slope",
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
