r"""Moments of 2-D pooling of independent Gaussian units (dDVI pooling layers).

**Average pooling** is linear: for a window :math:`\mathcal W` of :math:`k = k_H k_W` independent
units, :math:`E[\bar h] = \frac1k\sum_{\mathcal W} E[h]` and
:math:`\operatorname{Var}(\bar h) = \frac1{k^2}\sum_{\mathcal W}\operatorname{Var}(h)`, exactly.

**Max pooling** is moment-matched with Clark's (1961) formulas for the maximum of two Gaussians,
applied sequentially over the window: the running maximum is replaced by a Gaussian with its
exact mean and variance, then combined with the next unit. For independent
:math:`X_1 \sim \mathcal N(m_1, v_1)`, :math:`X_2 \sim \mathcal N(m_2, v_2)`, with
:math:`\theta = \sqrt{v_1 + v_2}`, :math:`d = m_1 - m_2`, :math:`\alpha = d/\theta`,

.. math::
    E[\max] &= m_1\Phi(\alpha) + m_2\Phi(-\alpha) + \theta\phi(\alpha),\\
    \operatorname{Var}(\max) &= v_1\Phi(\alpha) + v_2\Phi(-\alpha)
        + d^2\Phi(\alpha)\Phi(-\alpha) + d\,\theta\,\phi(\alpha)\,[\Phi(-\alpha) - \Phi(\alpha)]
        - \theta^2\phi(\alpha)^2 .

The variance is Clark's :math:`E[\max^2] - E[\max]^2` with the :math:`m^2` terms cancelled
algebraically (it is invariant to a common shift of :math:`m_1, m_2`), so means of order
:math:`10^4` do not cancel catastrophically. For two units this is exact; over a larger window
the running maximum is not Gaussian, and for four units of similar means the variance is off
by up to 30 % (measured against Monte Carlo), so it is not the default.

The default, ``method="quadrature"``, computes the *exact* first two moments of the maximum of
the window's independent Gaussians by one-dimensional quadrature of its CDF
:math:`F(x) = \prod_i \Phi((x - m_i)/s_i)`: with
:math:`L = \max_i(m_i - 8s_i)` (below which :math:`F \le \Phi(-8)`) and
:math:`U = \max_i(m_i + 8s_i)` (above which :math:`1 - F \le k\,\Phi(-8)`),

.. math::
    E[\max] = L + \int_L^U (1 - F(x))\,dx,\qquad
    E[(\max - L)^2] = 2\int_L^U (x - L)(1 - F(x))\,dx,

by ``points``-node Gauss-Legendre quadrature on :math:`[L, U]` (the nodes are fixed,
gradients flow through :math:`F`). A unit with a tiny :math:`s_i` makes :math:`F` a step, but
that step lies within :math:`16 s_i` of :math:`L` by construction, where an open rule whose
nodes cluster at the ends integrates it well (a closed rule such as Simpson's would put a
whole weight on the wrong side of the step). Both methods take
the units as independent (the diagonal approximation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._quadrature import constant, fixed_rule
from .special import normal_cdf, normal_pdf

__all__ = ["avg_pool2d_diag", "max_of_gaussians", "max_of_gaussians_quadrature", "max_pool2d_diag"]

_Size = int | tuple[int, int]


def _pair(v: _Size) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def avg_pool2d_diag(
    mean: Tensor, var: Tensor, kernel_size: _Size, stride: _Size | None = None
) -> tuple[Tensor, Tensor]:
    r"""Exact average pooling of independent Gaussians ``[..., C, H, W]`` (no padding).

    :math:`E = \operatorname{avgpool}(E[h])`,
    :math:`\operatorname{Var} = \operatorname{avgpool}(\operatorname{Var} h)/(k_H k_W)`.
    """
    kh, kw = _pair(kernel_size)
    stride = kernel_size if stride is None else stride
    return (
        F.avg_pool2d(mean, kernel_size, stride),
        F.avg_pool2d(var, kernel_size, stride) / (kh * kw),
    )


def _variance_floor(dtype: torch.dtype) -> float:
    eps = torch.finfo(dtype).eps
    return eps * eps


def max_of_gaussians(m1: Tensor, v1: Tensor, m2: Tensor, v2: Tensor) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of :math:`\max(X_1, X_2)` for independent Gaussians (Clark, 1961).

    Exact (see the module docstring). :math:`\theta^2 = v_1 + v_2` is floored at
    :math:`\varepsilon^2` (machine epsilon squared) so two deterministic inputs give their
    maximum with finite gradients; the variance is clamped at zero against round-off.
    """
    theta = (v1 + v2).clamp_min(_variance_floor(m1.dtype)).sqrt()
    d = m1 - m2
    alpha = d / theta
    cdf_a, cdf_b, pdf = normal_cdf(alpha), normal_cdf(-alpha), normal_pdf(alpha)
    mean = m1 * cdf_a + m2 * cdf_b + theta * pdf
    var = (
        v1 * cdf_a
        + v2 * cdf_b
        + d * d * cdf_a * cdf_b
        + d * theta * pdf * (cdf_b - cdf_a)
        - theta * theta * pdf * pdf
    )
    return mean, var.clamp_min(0)


@fixed_rule
def _gauss_legendre(points: int) -> tuple[Tensor, Tensor]:
    """Gauss-Legendre nodes and weights on ``[0, 1]`` (Golub-Welsch, float64).

    Computed once per ``points`` outside any tracing, kept as Python floats (:func:`fixed_rule`).
    """
    k = torch.arange(1, points, dtype=torch.float64)
    beta = k / torch.sqrt(4 * k * k - 1)
    jacobi = torch.diag(beta, 1) + torch.diag(beta, -1)
    nodes, vectors = torch.linalg.eigh(jacobi)
    return (nodes + 1) / 2, vectors[0] ** 2


def max_of_gaussians_quadrature(
    mean: Tensor, var: Tensor, points: int = 64
) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of :math:`\max_i X_i` over the last dimension, :math:`X_i` independent.

    Gauss-Legendre quadrature of the CDF of the maximum (see the module docstring).

    Args:
        mean: :math:`m_i`, shape ``[..., k]``.
        var: :math:`s_i^2 \ge 0`, same shape.
        points: quadrature nodes.

    Returns:
        ``(mean, var)`` of the maximum, shape ``[...]``.
    """
    if points < 2:
        raise ValueError(f"points must be an int >= 2, got {points}")
    sd = var.clamp_min(_variance_floor(var.dtype)).sqrt()
    with torch.no_grad():  # a fixed grid: gradients flow through the integrand only
        lo = (mean - 8 * sd).amax(-1, keepdim=True)
        width = (mean + 8 * sd).amax(-1, keepdim=True) - lo
        nodes, weights = (constant(t, mean.dtype, mean.device) for t in _gauss_legendre(points))
        offset = width * nodes  # [..., G], x - L
        weights = width * weights
    z = ((lo + offset).unsqueeze(-1) - mean.unsqueeze(-2)) / sd.unsqueeze(-2)  # [..., G, k]
    survival = 1.0 - normal_cdf(z).prod(-1)  # 1 - F(x)
    first = (weights * survival).sum(-1)  # E[max] - L
    second = (weights * 2 * offset * survival).sum(-1)  # E[(max - L)^2]
    return lo.squeeze(-1) + first, (second - first * first).clamp_min(0)


def _pad_never_winning(mean: Tensor, var: Tensor, ph: int, pw: int) -> tuple[Tensor, Tensor]:
    """Pad with deterministic units below every unit's 50-sigma range (see max_pool2d_diag)."""
    with torch.no_grad():
        low = (mean - 50 * var.sqrt()).amin() - 1
    inside = F.pad(torch.ones_like(mean[:1, :1]), (pw, pw, ph, ph)) > 0
    padded_mean = torch.where(inside, F.pad(mean, (pw, pw, ph, ph)), low)
    return padded_mean, F.pad(var, (pw, pw, ph, ph))


def max_pool2d_diag(
    mean: Tensor,
    var: Tensor,
    kernel_size: _Size,
    stride: _Size | None = None,
    method: str = "quadrature",
    points: int = 64,
    padding: _Size = 0,
) -> tuple[Tensor, Tensor]:
    r"""Moment-matched max pooling of independent Gaussians ``[B, C, H, W]``.

    Padding, as in ``torch.nn.functional.max_pool2d``, adds units that never win: each padded
    unit is a deterministic value one below :math:`\min(E[h] - 50\sqrt{\operatorname{Var} h})`
    over the batch, so its factor in the CDF of the maximum is exactly 1 and Clark's formula
    passes the other unit through (torch pads with :math:`-\infty`; a finite value keeps the
    formulas' gradients finite).

    Args:
        mean: pixel means.
        var: pixel variances.
        kernel_size: window ``k`` or ``(kH, kW)``.
        stride: default ``kernel_size``.
        method: ``"quadrature"`` (exact moments of the window's maximum, by
            :func:`max_of_gaussians_quadrature`) or ``"clark"`` (Clark's pairwise maximum,
            :func:`max_of_gaussians`, applied sequentially in row-major order; exact only for
            windows of two units).
        points: quadrature nodes.
        padding: units added on each side (at most half the window, as torch requires).

    Returns:
        ``(mean, var)``, each ``[B, C, H', W']`` with torch's ``max_pool2d`` output size.
    """
    if method not in ("quadrature", "clark"):
        raise ValueError(f"method must be 'quadrature' or 'clark', got {method!r}")
    kh, kw = _pair(kernel_size)
    sh, sw = _pair(kernel_size if stride is None else stride)
    ph, pw = _pair(padding)
    if ph < 0 or pw < 0 or 2 * ph > kh or 2 * pw > kw:
        raise ValueError(f"padding must be >= 0 and at most half the window, got {(ph, pw)}")
    if ph or pw:
        mean, var = _pad_never_winning(mean, var, ph, pw)
    b, c, h, w = mean.shape
    out_h, out_w = (h - kh) // sh + 1, (w - kw) // sw + 1
    if out_h < 1 or out_w < 1:
        raise ValueError(f"pooling window {(kh, kw)} is larger than the input {(h, w)}")

    def windows(t: Tensor) -> Tensor:  # [B*C, L, kh*kw]
        return F.unfold(t.reshape(b * c, 1, h, w), (kh, kw), stride=(sh, sw)).transpose(1, 2)

    mw, vw = windows(mean), windows(var)
    if method == "quadrature":
        m, v = max_of_gaussians_quadrature(mw, vw, points)
    else:
        m, v = mw[..., 0], vw[..., 0]
        for i in range(1, kh * kw):
            m, v = max_of_gaussians(m, v, mw[..., i], vw[..., i])
    return m.reshape(b, c, out_h, out_w), v.reshape(b, c, out_h, out_w)
