r"""Exact moments of ELU, :math:`f(a) = a` for :math:`a > 0`, :math:`\alpha(e^a - 1)` otherwise.

For :math:`a \sim \mathcal N(m, v)`, :math:`s = \sqrt v`, :math:`\mu = m/s`, write
:math:`f = \mathrm{relu}(a) + w(a)` with :math:`w = \alpha(e^{\min(a, 0)} - 1)`; the two parts
have disjoint supports, so :math:`E[\mathrm{relu}\cdot w] = 0` and

.. math::
    E f = E\,\mathrm{relu} + \alpha(T_1 - \Phi(-\mu)),\qquad
    \operatorname{Var} f = \operatorname{Var}\mathrm{relu} + \alpha^2 U
        - 2E[\mathrm{relu}]\,\alpha(T_1 - \Phi(-\mu)),

with the ReLU moments of :func:`~lightning_dvi.moments.relu_diag`,
:math:`T_k = E[e^{ka}; a \le 0] = e^{km + k^2v/2}\Phi(-\mu - ks)` and
:math:`U = \operatorname{Var} e^{\min(a,0)} = T_2 - T_1^2 - 2T_1\Phi(\mu) + \Phi(\mu)\Phi(-\mu)`.

*Numerics.* For :math:`\mu + s \le 0` the exponents are non-positive and
:math:`T_2 - T_1^2 = e^{2m+v}[\operatorname{expm1}(v) - e^v\delta_2 + \delta_1(2 - \delta_1)]`,
:math:`\delta_k = \Phi(\mu + ks)`, has no cancellation when the input is far below zero with a
small spread (where :math:`U \approx e^{2m+v}(e^v - 1)` is tiny against :math:`T_2`). Above,
:math:`T_k = \phi(\mu)R(\mu + ks)` with the Mills ratio :math:`R(x) = \Phi(-x)/\phi(x)` at
:math:`x \ge 0` (``erfc`` times ``exp`` up to :math:`x = 10`, its asymptotic series
:math:`(1 - x^{-2} + 3x^{-4} - 15x^{-6} + 105x^{-8})/x` beyond, relative error below
:math:`10^{-7}`), which cannot overflow.

*Derivatives* (slope, Mehler coefficients, backward pass): :math:`E f' = \Phi(\mu) + \alpha T_1`
and, for :math:`k \ge 2`, :math:`f^{(k)} = \alpha e^a[a<0] - \alpha\sum_{j\le k-3}\delta^{(j)}
+ (1-\alpha)\delta^{(k-2)}` (the jumps of :math:`f'` and :math:`f''` at 0), with
:math:`E\delta^{(j)}(a) = (-1)^j\mathrm{He}_j(\mu)\phi(\mu)/s^{j+1}`. The variance's
derivatives come from :math:`\tfrac12 E(f^2)' = E\,\mathrm{relu} + \alpha^2(T_2 - T_1)` and
:math:`\tfrac12E(f^2)'' = \Phi(\mu) + \alpha^2(2T_2 - T_1)` (:math:`(f^2)'` is continuous), so
the backward pass is closed form (:func:`~lightning_dvi.moments._quadrature.moments_from_stats`).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from ._mehler import mehler_cov
from ._quadrature import StatsFn, moments_from_stats
from ._relu import floors
from .activations import relu_diag

__all__ = ["elu_diag", "elu_full", "elu_slope"]

_Pair = tuple[Tensor, Tensor]
_SQRT_2PI = math.sqrt(2 * math.pi)
_SQRT_HALF = math.sqrt(0.5)
_MILLS_SWITCH = 10.0
_TAIL = 9.5  # erfc(9.5) ~ 4e-41: the upper tails below it are zero in float32 anyway


def _upper_tail(x: Tensor) -> Tensor:
    r""":math:`\Phi(-|x|)` (full relative precision), with the argument clamped where it underflows."""
    tail: Tensor = torch.special.erfc(x.abs().mul_(_SQRT_HALF).clamp_(max=_TAIL))
    return tail.mul_(0.5)


def _mills(x: Tensor, tail: Tensor) -> Tensor:
    r""":math:`R(x) = \Phi(-x)/\phi(x)` for :math:`x \ge 0`, given ``tail`` :math:`= \Phi(-x)`."""
    near = x.clamp(max=_MILLS_SWITCH)
    direct = torch.exp(near.square().mul_(0.5)).mul_(tail).mul_(_SQRT_2PI)
    inv2 = x.clamp(min=_MILLS_SWITCH).reciprocal_().square_()
    series = inv2.mul(105).sub_(15).mul_(inv2).add_(3).mul_(inv2).sub_(1).mul_(inv2).add_(1)
    return torch.where(x > _MILLS_SWITCH, series.mul_(inv2.sqrt_()), direct)


def _check_alpha(alpha: float) -> float:
    value = float(alpha)
    if not math.isfinite(value):
        raise ValueError(f"ELU alpha must be finite, got {alpha!r}")
    return value


def _stats(alpha: float, mean: Tensor, var: Tensor, order: int) -> Tensor:
    """Rows ``mean, var, c1, c2, e_1..e_order`` (the contract of ``moments_from_stats``)."""
    v = var.clamp_min(floors(var.dtype)[0])
    s = v.sqrt()
    m = mean
    mu = m / s
    a1, a2 = mu + s, mu + 2 * s
    # upper tails of |mu|, |a1|, |a2| (one erfc each), then both sides of each
    tails = _upper_tail(torch.stack([mu, a1, a2]))
    lows = torch.stack([mu, a1, a2]) <= 0  # where Phi(x) is the small tail
    below = torch.where(lows, tails, 1 - tails)  # Phi(x)
    above = torch.where(lows, 1 - tails, tails)  # Phi(-x)
    cdf, d1, d2 = below.unbind()
    cdf_neg = above[0]
    pdf = torch.exp(mu.square().mul_(-0.5)).mul_(1 / _SQRT_2PI)
    # T_k = E[e^{ka}; a <= 0], k = 1, 2: direct below a1 = 0 (exponents <= 0), Mills ratio above
    low = lows[1]
    expo = torch.stack([m + 0.5 * v, (m + v).mul_(2)]).clamp_(max=0).exp_().mul_(above[1:])
    mills = _mills(torch.stack([a1, a2]).clamp_(min=0), above[1:]).mul_(pdf)
    t1, t2 = torch.where(low, expo, mills).unbind()
    # T2 - T1^2 without cancellation for an input far below zero with a small spread
    vs = v.clamp(max=1)
    bracket = torch.expm1(vs).addcmul_(torch.exp(vs), d2, value=-1).addcmul_(d1, 2 - d1)
    ev = torch.exp((2 * m + v).clamp_(max=0))
    spread = torch.where(low & (v < 1), ev.mul_(bracket), torch.addcmul(t2, t1, t1, value=-1))
    u = spread.addcmul_(t1, cdf, value=-2).addcmul_(cdf, cdf_neg)
    r_mean, r_var = relu_diag(mean, var)
    w_mean = (t1 - cdf_neg).mul_(alpha)
    out_mean = r_mean + w_mean
    out_var = torch.addcmul(r_var, u, u.new_tensor(alpha * alpha)).addcmul_(
        r_mean, w_mean, value=-2
    )
    # E delta^(j)(a) = (-1)^j He_j(mu) phi(mu) / s^(j+1), j <= order - 2 (the kinks at 0);
    # s is floored there: e_k of a nearly deterministic unit near 0 is unbounded anyway
    inv_s = s.clamp_min(1e-8 if var.dtype == torch.float32 else 1e-60).reciprocal_()
    scale = pdf * inv_s
    delta = [scale]
    # phi(mu) underflows to exactly 0 beyond |mu| = 40 (both dtypes); the Hermite factor is
    # evaluated there at the clamp, where it is finite: He_j(mu) itself overflows (inf * 0 = NaN)
    mu_he = mu.clamp(-40.0, 40.0)
    he_prev, he = torch.ones_like(mu), mu_he
    for j in range(1, order - 1):
        scale = scale * inv_s
        delta.append(he * scale * (-1) ** j)
        he_prev, he = he, mu_he * he - j * he_prev
    a_t1 = alpha * t1
    e = [cdf + a_t1]
    acc = torch.zeros_like(mu)  # sum of the delta^(j), j <= k - 3
    for k in range(2, order + 1):
        e.append(torch.add(a_t1, delta[k - 2], alpha=1 - alpha).sub_(acc, alpha=alpha))
        acc = acc + delta[k - 2]
    a2_ = alpha * alpha
    c1 = torch.add(r_mean, t2 - t1, alpha=a2_).addcmul_(out_mean, e[0], value=-1)
    c2 = torch.add(cdf, 2 * t2 - t1, alpha=a2_).addcmul_(out_mean, e[1], value=-1)
    return torch.stack([out_mean, out_var.clamp_(min=0), c1, c2, *e])


def _stats_fn(alpha: float) -> StatsFn:
    return functools.partial(_stats, _check_alpha(alpha))


def elu_diag(mean: Tensor, var: Tensor, alpha: float = 1.0) -> _Pair:
    r"""Exact mean and variance of :math:`\mathrm{ELU}_\alpha(a)`, :math:`a\sim\mathcal N(m, v)`.

    Closed forms of the module docstring, with a closed-form backward pass.

    Args:
        mean: :math:`m`, any shape.
        var: :math:`v \ge 0`, same shape.
        alpha: :math:`\alpha` (``torch.nn.ELU``'s ``alpha``), any finite number.
    """
    out = moments_from_stats(_stats_fn(alpha), mean, var)
    return out[0], out[1]


def elu_slope(mean: Tensor, var: Tensor, alpha: float = 1.0) -> Tensor:
    r""":math:`E[f'(a)] = \Phi(\mu) + \alpha E[e^a; a \le 0]` (skip connections)."""
    return moments_from_stats(_stats_fn(alpha), mean, var, 1)[2]


def elu_full(mean: Tensor, cov: Tensor, alpha: float = 1.0) -> _Pair:
    r"""Mean and covariance of ELU: exact diagonal, three-term Mehler series off it.

    The off-diagonal form is :func:`~lightning_dvi.moments._mehler.mehler_cov` with
    :math:`e_k = E f^{(k)}(a)` from the closed forms above; ELU's kink makes the series converge
    more slowly than for the smooth activations (measured error in ``docs/moments.md``).
    """
    var = cov.diagonal(dim1=-2, dim2=-1)
    out_mean, out_var, *derivs = moments_from_stats(_stats_fn(alpha), mean, var, 3)
    return out_mean, mehler_cov(cov, torch.stack(derivs, -1), out_var)
