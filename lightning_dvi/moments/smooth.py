r"""Moments of LeakyReLU, GELU, SiLU, Tanh and Sigmoid applied to a Gaussian vector.

For :math:`a \sim \mathcal N(m, \Sigma)` and :math:`h = f(a)` elementwise, write :math:`v_j =
\Sigma_{jj}`, :math:`s_j = \sqrt{v_j}`, :math:`\rho_{jl} = \Sigma_{jl}/(s_j s_l)`.

**Diagonal (mean and variance).**

* LeakyReLU :math:`f(a) = \alpha a + (1-\alpha)\max(0, a)`: exact, from the ReLU moments and
  Stein's lemma :math:`\operatorname{Cov}(a, \max(0,a)) = v\,\Phi(m/s)`.
* GELU :math:`f(a) = a\Phi(a)`: exact closed forms. With :math:`h = m/\sqrt{1+v}`,
  :math:`A = \phi(h)/\sqrt{1+v}`, :math:`E[f] = m\Phi(h) + vA`; the second moment uses
  :math:`E[\Phi(a)^2] = \Phi(h)^2 + P`, where Plackett's identity with :math:`r = \sin\theta`
  gives the bivariate-normal excess as a smooth integral,
  :math:`P = \frac1{2\pi}\int_0^{\arcsin\rho_0} e^{-h^2/(1+\sin\theta)}\,d\theta`,
  :math:`\rho_0 = v/(1+v)`, evaluated by 32-node Gauss–Legendre (see :func:`gelu_diag`).
* Sigmoid, SiLU and Tanh (:math:`\tanh x = 2\sigma(2x) - 1`): no closed form exists. For
  :math:`s \le 1`, ``num_nodes``-point Gauss–Hermite quadrature,
  :math:`E[g(a)] \approx \sum_i w_i\, g(m + s z_i)`, in the input dtype, with the variance as
  :math:`\sum_i w_i (f_i - \bar f)^2` (non-negative, exact at :math:`v = 0`, no cancellation
  at tiny :math:`v`). For :math:`s > 1`, where Gauss–Hermite would need ever more nodes, the
  logistic representation :math:`\sigma(x) = P(L < x)` moves the integral onto the logistic
  density (:func:`_logistic_grid`), accurate to ~1e-9 at any :math:`s`. Measured errors are in
  ``docs/moments.md``.
* GELU with ``approximate="tanh"``: Gauss–Hermite only (accurate while :math:`s \lesssim 2`).

**Off-diagonal (full mode).** Mehler's expansion of the bivariate normal density gives, exactly,

.. math::
    \operatorname{Cov}(h_j, h_l) = \sum_{k\ge1} \frac{\rho_{jl}^k}{k!}\, c_{jk} c_{lk},\qquad
    c_{jk} = E[f(a_j)\,\mathrm{He}_k(z_j)] = s_j^k\,E[f^{(k)}(a_j)].

The first term is the linearised (Stein) form :math:`E[f'_j]\Sigma_{jl}E[f'_l]`. The smooth
activations keep :math:`K = 3` terms, which makes each term a Hadamard product of PSD matrices
(Schur), and put the exact variances on the diagonal; by Parseval
:math:`\operatorname{Var} h_j = \sum_k c_{jk}^2/k!`, so the diagonal only grows and the result is
PSD. The truncation error is bounded by Cauchy–Schwarz:
:math:`|R_{jl}| \le |\rho_{jl}|^{K+1}\sqrt{T_j T_l}` with
:math:`T_j = \operatorname{Var} h_j - \sum_{k\le K} c_{jk}^2/k!` (:func:`hermite_tail_bound`).
LeakyReLU instead carries the ReLU's corrected off-diagonal form through the linear mix.

**Slopes.** :math:`E[f'(a)]` for skip connections (Stein's lemma), from the same closed forms
or quadrature.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._relu import floors
from .activations import relu_diag, relu_full, relu_slope
from .special import normal_cdf, normal_pdf

__all__ = [
    "DEFAULT_NODES",
    "HERMITE_ORDER",
    "gelu_diag",
    "gelu_full",
    "gelu_slope",
    "gelu_tanh_diag",
    "gelu_tanh_full",
    "gelu_tanh_slope",
    "hermite_cov",
    "hermite_tail_bound",
    "leaky_relu_diag",
    "leaky_relu_full",
    "leaky_relu_slope",
    "quadrature_moments",
    "quadrature_rule",
    "sigmoid_diag",
    "sigmoid_full",
    "sigmoid_slope",
    "silu_diag",
    "silu_full",
    "silu_slope",
    "tanh_diag",
    "tanh_full",
    "tanh_slope",
]

DEFAULT_NODES = 32
"""Gauss–Hermite nodes used by the quadrature-based activations."""
HERMITE_ORDER = 3
"""Terms :math:`K` of the Mehler series kept off the diagonal."""

_Fn = Callable[[Tensor], Tensor]
_Pair = tuple[Tensor, Tensor]
_INV_2PI = 1.0 / (2.0 * math.pi)
_INV_2SQRT_PI = 0.5 / math.sqrt(math.pi)
_GL_NODES = 32


def _var_floor(dtype: torch.dtype) -> float:
    return floors(dtype)[0]  # the variance floor of every moment kernel (one home: _relu)


def _correlation(cov: Tensor) -> Tensor:
    r""":math:`\rho = \Sigma_{jl}/(\sigma_j\sigma_l)` clamped to :math:`[-1, 1]` (floored variances)."""
    sd = cov.diagonal(dim1=-2, dim2=-1).clamp_min(_var_floor(cov.dtype)).sqrt()
    return (cov / (sd.unsqueeze(-1) * sd.unsqueeze(-2))).clamp(-1, 1)


def _set_diagonal(cov: Tensor, diag: Tensor) -> Tensor:
    """``cov`` with its diagonal replaced by ``diag``, out of place.

    A mask instead of ``torch.diagonal_scatter``, whose decomposition writes into a diagonal
    view, which the ONNX exporter cannot functionalise.
    """
    eye = torch.eye(cov.shape[-1], dtype=torch.bool, device=cov.device)
    return torch.where(eye, torch.diag_embed(diag), cov)


def _symmetric(cov: Tensor) -> Tensor:
    return 0.5 * (cov + cov.transpose(-1, -2))


# --------------------------------------------------------------------------- quadrature rules
@functools.lru_cache(maxsize=16)
def _gauss_hermite(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Probabilists' Gauss–Hermite nodes and weights (weights sum to one), Golub–Welsch."""
    if n < 2:
        raise ValueError(f"num_nodes must be >= 2, got {n}")
    off = torch.sqrt(torch.arange(1, n, dtype=torch.float64))
    jacobi = torch.diag(off, 1) + torch.diag(off, -1)
    nodes, vecs = torch.linalg.eigh(jacobi)
    weights = vecs[0] ** 2
    weights = weights / weights.sum()
    return tuple(nodes.tolist()), tuple(weights.tolist())


@functools.lru_cache(maxsize=4)
def _gauss_legendre_unit(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Gauss–Legendre nodes and weights on [0, 1] (Golub–Welsch)."""
    k = torch.arange(1, n, dtype=torch.float64)
    off = k / torch.sqrt(4 * k * k - 1)
    nodes, vecs = torch.linalg.eigh(torch.diag(off, 1) + torch.diag(off, -1))
    weights = vecs[0] ** 2  # sums to 1 over [-1, 1] with weight 1/2
    return tuple(((nodes + 1) / 2).tolist()), tuple(weights.tolist())


# Built eagerly, outside any tracing: torch.export / torch.compile must find them cached (an
# eigh traced into a graph would not export, and a cached traced value would leak symbols).
_gauss_hermite(DEFAULT_NODES)
_gauss_legendre_unit(_GL_NODES)


def quadrature_rule(num_nodes: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Gauss–Hermite nodes and weights (probabilists', weights summing to one), cached.

    Modules call it at construction so that tracing (``torch.export``) finds the rule cached.
    """
    return _gauss_hermite(int(num_nodes))


def _rule(table: tuple[tuple[float, ...], tuple[float, ...]], like: Tensor) -> _Pair:
    nodes, weights = table
    return (
        torch.tensor(nodes, dtype=like.dtype, device=like.device),
        torch.tensor(weights, dtype=like.dtype, device=like.device),
    )


def _hermite_polys(z: Tensor, order: int) -> list[Tensor]:
    """Probabilists' Hermite polynomials He_1 .. He_K at ``z`` (He_{k+1} = z He_k - k He_{k-1})."""
    prev, cur = torch.ones_like(z), z
    out = [cur]
    for k in range(1, order):
        prev, cur = cur, z * cur - k * prev
        out.append(cur)
    return out


def quadrature_moments(
    fn: _Fn,
    dfn: _Fn,
    mean: Tensor,
    var: Tensor,
    num_nodes: int = DEFAULT_NODES,
    order: int = HERMITE_ORDER,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    r"""Mean, variance, slope and Hermite coefficients of :math:`f(a)`, :math:`a\sim\mathcal N(m, v)`.

    Gauss–Hermite quadrature in the input dtype (not upcast to float64: ONNX Runtime has
    no float64 ``Erf``, and an exported float32 network must stay float32):
    :math:`E[f] = \sum_i w_i f_i`, :math:`\operatorname{Var} = \sum_i w_i (f_i - E[f])^2`,
    :math:`E[f'] = \sum_i w_i f'_i`, :math:`c_k = \sum_i w_i f_i \mathrm{He}_k(z_i)`
    (:math:`c_1` is replaced by the exact :math:`s\,E[f']`), with :math:`f_i = f(m + s z_i)`.

    Args:
        fn: the activation, elementwise.
        dfn: its derivative.
        mean: :math:`m`, any shape.
        var: :math:`v \ge 0`, same shape.
        num_nodes: quadrature nodes.
        order: number :math:`K` of Hermite coefficients returned.

    Returns:
        ``(mean, var, slope, coeffs)``; ``coeffs`` has a trailing dimension of size ``order``.
    """
    dtype = mean.dtype
    z, w = _rule(_gauss_hermite(int(num_nodes)), mean)
    m = mean.unsqueeze(-1)
    v = var.clamp_min(_var_floor(dtype)).unsqueeze(-1)
    s = v.sqrt()
    x = m + s * z
    fx = fn(x)
    out_mean = (fx * w).sum(-1, keepdim=True)
    out_var = ((fx - out_mean).square() * w).sum(-1)
    slope = (dfn(x) * w).sum(-1)
    coeffs = [s.squeeze(-1) * slope]
    coeffs += [(fx * he * w).sum(-1) for he in _hermite_polys(z, order)[1:]]
    stacked = torch.stack(coeffs, -1)
    # Below ~sqrt(eps) the two-pass variance is rounding noise (eps |f|)^2; the first Mehler
    # term (the delta method, error O(v^2)) is exact to working precision there.
    tiny = (s.squeeze(-1) < (1e-6 if dtype == torch.float64 else 1e-3)).unsqueeze(-1)
    out_var = torch.where(tiny.squeeze(-1), stacked[..., 0].square(), out_var)
    stacked = torch.where(tiny, torch.cat([stacked[..., :1], 0 * stacked[..., 1:]], -1), stacked)
    # a deterministic input (v = 0) has exactly zero output spread, not the floor's ~1e-30
    random = var > 0
    out_var = torch.where(random, out_var, torch.zeros_like(out_var))
    stacked = torch.where(random.unsqueeze(-1), stacked, torch.zeros_like(stacked))
    return (
        out_mean.squeeze(-1).to(dtype),
        out_var.to(dtype),
        slope.to(dtype),
        stacked.to(dtype),
    )


def hermite_cov(cov: Tensor, coeffs: Tensor, out_var: Tensor) -> Tensor:
    r"""Off-diagonal covariance :math:`\sum_{k\le K}\rho^k c_{jk}c_{lk}/k!`, exact diagonal.

    Args:
        cov: input covariance ``[..., D, D]``.
        coeffs: Hermite coefficients ``[..., D, K]``.
        out_var: exact output variances ``[..., D]`` (put on the diagonal).

    Returns:
        The output covariance ``[..., D, D]``, symmetric and PSD up to round-off.
    """
    rho = _correlation(cov)
    out = torch.zeros_like(rho)
    power = torch.ones_like(rho)
    for k in range(coeffs.shape[-1]):
        power = power * rho
        c = coeffs[..., k]
        out = out + power * (c.unsqueeze(-1) * c.unsqueeze(-2)) / math.factorial(k + 1)
    out = _symmetric(out)
    return _set_diagonal(out, out_var)


def hermite_tail_bound(coeffs: Tensor, out_var: Tensor, cov: Tensor) -> Tensor:
    r"""Bound :math:`|\rho_{jl}|^{K+1}\sqrt{T_jT_l}` on the truncation error of :func:`hermite_cov`."""
    tail = (out_var - (coeffs.square() / _factorials(coeffs)).sum(-1)).clamp_min(0)
    rho = _correlation(cov)
    t = tail.sqrt()
    return rho.abs() ** (coeffs.shape[-1] + 1) * t.unsqueeze(-1) * t.unsqueeze(-2)


def _factorials(coeffs: Tensor) -> Tensor:
    k = coeffs.shape[-1]
    return torch.tensor(
        [math.factorial(i + 1) for i in range(k)], dtype=coeffs.dtype, device=coeffs.device
    )


def _psd_floor(out_var: Tensor, coeffs: Tensor) -> Tensor:
    # Parseval: Var >= sum_k c_k^2 / k!; quadrature error must not break that (PSD).
    return torch.maximum(out_var, (coeffs.square() / _factorials(coeffs)).sum(-1))


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
    return a * mean + (1 - a) * r_mean, out_var.clamp_min(0)


def leaky_relu_slope(mean: Tensor, var: Tensor, negative_slope: float = 0.01) -> Tensor:
    r""":math:`E[f'(a)] = \alpha + (1-\alpha)\Phi(\mu)`."""
    a = float(negative_slope)
    return a + (1 - a) * relu_slope(mean, var)


def leaky_relu_full(mean: Tensor, cov: Tensor, negative_slope: float = 0.01) -> _Pair:
    r"""Mean and covariance of LeakyReLU; diagonal exact, off-diagonal through the ReLU form.

    .. math::
        \operatorname{Cov}(h_j, h_l) = \alpha^2\Sigma_{jl}
            + \alpha(1-\alpha)\Sigma_{jl}(\Phi_j + \Phi_l) + (1-\alpha)^2 C^{\mathrm{relu}}_{jl},

    using :math:`\operatorname{Cov}(a_j, \max(0, a_l)) = \Sigma_{jl}\Phi_l` (Stein, exact).
    """
    a = float(negative_slope)
    var = cov.diagonal(dim1=-2, dim2=-1)
    r_mean, r_cov = relu_full(mean, cov)
    cdf = relu_slope(mean, var)
    mixed = cov * (cdf.unsqueeze(-1) + cdf.unsqueeze(-2))
    out_cov = a * a * cov + a * (1 - a) * mixed + (1 - a) ** 2 * r_cov
    out_var = leaky_relu_diag(mean, var, a)[1]
    out_cov = _set_diagonal(_symmetric(out_cov), out_var)
    return a * mean + (1 - a) * r_mean, out_cov


# ------------------------------------------------------------------------------------ GELU
def _gelu_parts(mean: Tensor, var: Tensor) -> dict[str, Tensor]:
    """Closed-form pieces shared by the GELU moments."""
    m, v = mean, var.clamp_min(0)
    one_v = 1 + v
    root = one_v.sqrt()
    h = m / root
    amp = normal_pdf(h) / root  # E[phi(a)]
    m1, v1 = m / one_v, v / one_v  # phi(x) N(x; m, v) = amp * N(x; m1, v1)
    return {"m": m, "v": v, "h": h, "amp": amp, "m1": m1, "v1": v1, "cdf": normal_cdf(h)}


def _plackett_excess(h: Tensor, v: Tensor) -> Tensor:
    r""":math:`\Phi_2(h, h; \rho_0) - \Phi(h)^2` for :math:`\rho_0 = v/(1+v)` (Plackett)."""
    # arcsin(v / (1 + v)) = atan(v / sqrt(1 + 2v)): no singular derivative as v -> inf
    upper = torch.atan(v / torch.sqrt(1 + 2 * v))
    u, w = _rule(_gauss_legendre_unit(_GL_NODES), h)
    theta = upper.unsqueeze(-1) * u
    integrand = torch.exp(-h.square().unsqueeze(-1) / (1 + torch.sin(theta)))
    return _INV_2PI * upper * (integrand * w).sum(-1)


def gelu_diag(mean: Tensor, var: Tensor) -> _Pair:
    r"""Exact mean and variance of :math:`\mathrm{GELU}(a) = a\Phi(a)`, :math:`a\sim\mathcal N(m, v)`.

    With :math:`h = m/\sqrt{1+v}`, :math:`A = \phi(h)/\sqrt{1+v}` (:math:`= E\phi(a)`) and the
    tilted moments :math:`m_1 = m/(1+v)`, :math:`v_1 = v/(1+v)`
    (:math:`\phi(x)\mathcal N(x; m, v) = A\,\mathcal N(x; m_1, v_1)`):

    .. math::
        E[h] = m\Phi(h) + vA,\qquad
        E[f^2] = (m^2+v)E[\Phi^2] + 4mv\,E[\Phi\phi] + 2v^2(E[\phi^2] - E[a\Phi\phi]),

    (Stein's lemma twice on :math:`g = \Phi^2`), :math:`E[\Phi^2] = \Phi(h)^2 + P`
    (module docstring), :math:`E[\Phi\phi] = A\Phi(h_1)`, :math:`h_1 = m_1/\sqrt{1+v_1}`,
    :math:`E[a\Phi\phi] = A[m_1\Phi(h_1) + v_1\phi(h_1)/\sqrt{1+v_1}]`,
    :math:`E[\phi^2] = \mathcal N(m; 0, v+\tfrac12)/(2\sqrt\pi)`. The variance is assembled with
    the :math:`m^2\Phi(h)^2` terms cancelled analytically.
    """
    p = _gelu_parts(mean, var)
    m, v, amp, m1, v1, cdf = p["m"], p["v"], p["amp"], p["m1"], p["v1"], p["cdf"]
    out_mean = m * cdf + v * amp
    root1 = torch.sqrt(1 + v1)
    h1 = m1 / root1
    e_cdf_pdf = amp * normal_cdf(h1)
    e_a_cdf_pdf = amp * (m1 * normal_cdf(h1) + v1 * normal_pdf(h1) / root1)
    half = v + 0.5
    e_pdf2 = torch.exp(-0.5 * m * m / half) / torch.sqrt(2 * math.pi * half) * _INV_2SQRT_PI
    excess = _plackett_excess(p["h"], v)
    # E[f^2] - E[f]^2 with (m^2 + v) Phi(h)^2 - (m Phi(h))^2 = v Phi(h)^2 done by hand
    out_var = (
        v * cdf * cdf
        + (m * m + v) * excess
        + 4 * m * v * e_cdf_pdf
        + 2 * v * v * (e_pdf2 - e_a_cdf_pdf)
        - 2 * m * v * cdf * amp
        - v * v * amp * amp
    )
    out_var = torch.maximum(out_var, v * _gelu_slope_parts(p).square())
    return out_mean.to(mean.dtype), out_var.to(mean.dtype)


def _gelu_slope_parts(p: dict[str, Tensor]) -> Tensor:
    return p["cdf"] + p["amp"] * p["m1"]


def gelu_slope(mean: Tensor, var: Tensor) -> Tensor:
    r""":math:`E[\Phi(a) + a\phi(a)] = \Phi(h) + A m_1`."""
    return _gelu_slope_parts(_gelu_parts(mean, var)).to(mean.dtype)


def _gelu_coeffs(mean: Tensor, var: Tensor) -> Tensor:
    r""":math:`c_k = s^k E[f^{(k)}]`, with :math:`f'' = (2 - a^2)\phi`, :math:`f''' = (a^3 - 4a)\phi`."""
    p = _gelu_parts(mean, var)
    amp, m1, v1, v = p["amp"], p["m1"], p["v1"], p["v"]
    s = v.clamp_min(_var_floor(mean.dtype)).sqrt()
    d2 = amp * (2 - m1 * m1 - v1)
    d3 = amp * (m1**3 + 3 * m1 * v1 - 4 * m1)
    out = torch.stack([s * _gelu_slope_parts(p), v * d2, s * v * d3], -1)
    return out.to(mean.dtype)


def gelu_full(mean: Tensor, cov: Tensor) -> _Pair:
    """GELU mean and covariance: exact diagonal, Mehler series (:func:`hermite_cov`) off it."""
    var = cov.diagonal(dim1=-2, dim2=-1)
    out_mean, out_var = gelu_diag(mean, var)
    return out_mean, hermite_cov(cov, _gelu_coeffs(mean, var), out_var)


# -------------------------------------------------------------- quadrature-based activations
def _sigmoid(x: Tensor) -> Tensor:
    return torch.sigmoid(x)


def _dsigmoid(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 - s)


def _silu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(x)


def _dsilu(x: Tensor) -> Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


_K_TANH = math.sqrt(2.0 / math.pi)
_C_TANH = 0.044715


def _gelu_tanh(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.tanh(_K_TANH * (x + _C_TANH * x**3)))


def _dgelu_tanh(x: Tensor) -> Tensor:
    t = torch.tanh(_K_TANH * (x + _C_TANH * x**3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _K_TANH * (1 + 3 * _C_TANH * x * x)


def _gh_or_grid(kind: str, mean: Tensor, var: Tensor, num_nodes: int) -> tuple[Tensor, ...]:
    """Quadrature moments: Gauss–Hermite for small sd, the logistic grid for large (``kind``)."""
    fn, dfn = _QUAD_FNS[kind]
    gh = quadrature_moments(fn, dfn, mean, var, num_nodes)
    if kind == "gelu_tanh":
        return gh
    floor = _SWITCH_SD * _SWITCH_SD
    wide = var > floor
    grid = _logistic_grid(kind, mean, torch.where(wide, var, torch.full_like(var, floor)))
    return tuple(
        torch.where(wide.unsqueeze(-1) if g.dim() > wide.dim() else wide, r, g)
        for g, r in zip(gh, grid, strict=True)
    )


_SWITCH_SD = 1.0
_GRID_STEP = 0.5
_GRID_HALF = 36.0


def _logistic_grid(kind: str, mean: Tensor, var: Tensor) -> tuple[Tensor, ...]:
    r"""Sigmoid/SiLU moments for :math:`s > 1` by the logistic representation.

    :math:`\sigma(x) = P(L < x)` for a standard logistic :math:`L`, so
    :math:`E[\sigma(a)] = \int \Phi((m-t)/s)\,\sigma'(t)\,dt` and
    :math:`E[\sigma(a)^2] = \int \Phi((m-t)/s)\,2\sigma\sigma'(t)\,dt` (the density of the
    larger of two logistics); derivatives of :math:`E[\sigma^{(k)}(a)]` move onto the Gaussian,
    :math:`s^kE[\sigma^{(k)}(a)] = J_{k-1} = \int\sigma'(t)\mathrm{He}_{k-1}(z_t)\phi(z_t)dt`,
    :math:`z_t = (t-m)/s`. The integrands are smooth on the scale of :math:`s` and of
    :math:`\sigma'` (poles at :math:`\pm i\pi`), so the trapezoid rule with step 0.5 on
    :math:`[-36, 36]` is accurate to ~1e-15 where Gauss–Hermite would need ever more nodes.
    """
    dtype = mean.dtype
    t = torch.arange(-_GRID_HALF, _GRID_HALF + _GRID_STEP / 2, _GRID_STEP, dtype=torch.float64)
    t = t.to(device=mean.device, dtype=mean.dtype)
    sig = torch.sigmoid(t)
    rho1 = sig * (1 - sig)
    rho2 = 2 * sig * rho1
    m = mean.unsqueeze(-1)
    s = var.sqrt().unsqueeze(-1)
    z = (t - m) / s
    upper, pdf = normal_cdf(-z), normal_pdf(z)
    hes = [torch.ones_like(z), *_hermite_polys(z, 3)]
    j1 = [_GRID_STEP * (rho1 * pdf * he).sum(-1) for he in hes]
    i1 = _GRID_STEP * (upper * rho1).sum(-1)
    i2 = _GRID_STEP * (upper * rho2).sum(-1)
    s, m = s.squeeze(-1), m.squeeze(-1)
    if kind == "sigmoid":
        out = (i1, (i2 - i1 * i1).clamp_min(0), j1[0] / s, torch.stack(j1[:3], -1))
    else:  # silu: f = a sigma(a); Stein's lemma moves each a onto the Gaussian
        j2_0 = _GRID_STEP * (rho2 * pdf).sum(-1)
        j2_1 = _GRID_STEP * (rho2 * pdf * z).sum(-1)
        mean_f = m * i1 + s * j1[0]
        second = (m * m + s * s) * i2 + 2 * m * s * j2_0 + s * s * j2_1
        slope = i1 + m * j1[0] / s + j1[1]
        c2 = 2 * s * j1[0] + m * j1[1] + s * j1[2]
        c3 = 3 * s * j1[1] + m * j1[2] + s * j1[3]
        coeffs = torch.stack([s * slope, c2, c3], -1)
        out = (mean_f, (second - mean_f * mean_f).clamp_min(0), slope, coeffs)
    return tuple(o.to(dtype) for o in out)


def _moments(kind: str, mean: Tensor, var: Tensor, num_nodes: int) -> tuple[Tensor, ...]:
    if kind == "tanh":  # tanh(x) = 2 sigmoid(2x) - 1
        m, v, slope, coeffs = _gh_or_grid("sigmoid", 2 * mean, 4 * var, num_nodes)
        return 2 * m - 1, 4 * v, 4 * slope, 2 * coeffs
    return _gh_or_grid(kind, mean, var, num_nodes)


def _family(kind: str, name: str) -> tuple[Callable[..., Any], ...]:
    def diag(mean: Tensor, var: Tensor, num_nodes: int = DEFAULT_NODES) -> _Pair:
        out_mean, out_var, _, coeffs = _moments(kind, mean, var, num_nodes)
        return out_mean, _psd_floor(out_var, coeffs)

    def full(mean: Tensor, cov: Tensor, num_nodes: int = DEFAULT_NODES) -> _Pair:
        var = cov.diagonal(dim1=-2, dim2=-1)
        out_mean, out_var, _, coeffs = _moments(kind, mean, var, num_nodes)
        return out_mean, hermite_cov(cov, coeffs, _psd_floor(out_var, coeffs))

    def slope(mean: Tensor, var: Tensor, num_nodes: int = DEFAULT_NODES) -> Tensor:
        return _moments(kind, mean, var, num_nodes)[2]

    how = (
        "Gauss–Hermite quadrature"
        if kind == "gelu_tanh"
        else "Gauss–Hermite quadrature (sd <= 1) or the logistic grid (sd > 1)"
    )
    diag.__doc__ = f"Mean and variance of {name}(a), a ~ N(mean, var), by {how}."
    full.__doc__ = (
        f"Mean and covariance of {name}(a): {how} on the diagonal, Mehler series off it "
        "(:func:`hermite_cov`)."
    )
    slope.__doc__ = f"E[{name}'(a)] by {how} (skip connections)."
    for f, suffix in ((diag, "diag"), (full, "full"), (slope, "slope")):
        f.__name__ = f.__qualname__ = f"{kind}_{suffix}"
    return diag, full, slope


_QUAD_FNS: dict[str, tuple[_Fn, _Fn]] = {
    "sigmoid": (_sigmoid, _dsigmoid),
    "silu": (_silu, _dsilu),
    "gelu_tanh": (_gelu_tanh, _dgelu_tanh),
}

sigmoid_diag, sigmoid_full, sigmoid_slope = _family("sigmoid", "sigmoid")
tanh_diag, tanh_full, tanh_slope = _family("tanh", "tanh")
silu_diag, silu_full, silu_slope = _family("silu", "silu")
gelu_tanh_diag, gelu_tanh_full, gelu_tanh_slope = _family("gelu_tanh", "gelu (tanh approximation)")
