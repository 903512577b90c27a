r"""Moments of RMS normalization of a Gaussian vector (``RMSNorm``, before its gain).

For :math:`a \sim \mathcal N(\mu, \Sigma)` in :math:`\mathbb R^D`,

.. math::
    y = \frac{a}{\sqrt s},\qquad s = \tfrac1D\lVert a\rVert^2 + \epsilon,

layer normalization without the centring (:mod:`.layer_norm` has the derivation). The powers
of :math:`s` are Laplace transforms, :math:`s^{-p} = \Gamma(p)^{-1}\int_0^\infty t^{p-1}
e^{-ts}dt`, and under the tilt :math:`e^{-\tau\lVert a\rVert^2}` (:math:`\tau = t/D`) a Gaussian
stays Gaussian: with :math:`\Sigma = U\Lambda U^\top`, :math:`\tilde m = U^\top\mu`,
:math:`q_k = 1/(1 + 2\tau\lambda_k)`,

.. math::
    \log Z(\tau) = \tfrac12\textstyle\sum_k\log q_k - \tau\sum_k q_k\tilde m_k^2,\qquad
    E[y] = \frac{1}{\Gamma(\frac12)}\int_0^\infty t^{-1/2}e^{-t\epsilon}Z\,U(q\circ\tilde m)\,dt,

    E[yy^\top] = \int_0^\infty e^{-t\epsilon}Z\,U\big(\operatorname{diag}(q\lambda)
        + (q\circ\tilde m)(q\circ\tilde m)^\top\big)U^\top dt,

by the double-exponential rule of :mod:`.layer_norm` (exact up to that quadrature). For a
diagonal :math:`\Sigma = \operatorname{diag}(v)` the coordinates stay independent under the
tilt: :math:`q_i = 1/(1 + 2\tau v_i)`, no eigendecomposition, :math:`O(D)` per node.

Where the input variance is negligible against the spread of the means
(:math:`\operatorname{tr}\Sigma/(\lVert\mu\rVert^2 + D\epsilon) <` :data:`~.layer_norm.TIGHT_RATIO`)
the first-order form :math:`y \approx \mu/\sqrt{s_0} + J(a - \mu)`,
:math:`J = (I - \mu\mu^\top/(Ds_0))/\sqrt{s_0}`, :math:`s_0 = \lVert\mu\rVert^2/D + \epsilon`,
takes over (the variance would cancel to rounding error). A skip connection's
cross-covariance passes through :math:`E[\nabla y] = E[s^{-1/2}]I - \tfrac1D E[aa^\top s^{-3/2}]`
(Stein's lemma, :func:`rms_normalize_jacobian`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .layer_norm import TIGHT_RATIO, _grid, _weights
from .special import flush

__all__ = ["rms_normalize_diag", "rms_normalize_full", "rms_normalize_jacobian"]


def _tight(trace: Tensor, mean: Tensor, eps: float) -> Tensor:
    d = mean.shape[-1]
    return trace / ((mean * mean).sum(-1) + d * eps) < TIGHT_RATIO


def _linear(mean: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(mean / sqrt(s0), s0 [..., 1], J [..., D, D])`` of the first-order form."""
    d = mean.shape[-1]
    s0 = (mean * mean).mean(-1, keepdim=True) + eps
    eye = torch.eye(d, dtype=mean.dtype, device=mean.device)
    jac = eye - mean.unsqueeze(-1) * mean.unsqueeze(-2) / (d * s0.unsqueeze(-1))
    return mean / s0.sqrt(), s0, jac / s0.sqrt().unsqueeze(-1)


def _rms_diag(mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    d = mean.shape[-1]
    s_bar = (mean * mean + var).mean(-1) + eps
    t, base = _grid(s_bar, eps, mean.dtype)
    tau = (t / d).unsqueeze(-1)
    q = flush(1 / (1 + 2 * tau * var))
    base = base + 0.5 * q.log().sum(-1) - (tau * q * mean * mean).sum(-1)
    w_half = _weights(base, t, 0.5).unsqueeze(-1)
    w_one = _weights(base, t, 1.0).unsqueeze(-1)
    ey = (w_half * q * mean).sum(0)
    ey2 = (w_one * (q * var + (q * mean) ** 2)).sum(0)
    out_var = (ey2 - ey * ey).clamp_min(0)
    mh, s0, _ = _linear(mean, eps)
    lin_var = (
        var - 2 * mh * mh * var / d + mh * mh * (mh * mh * var).sum(-1, keepdim=True) / d**2
    ) / s0
    tight = _tight(var.sum(-1), mean, eps).unsqueeze(-1)
    return torch.where(tight, mh, ey), torch.where(tight, lin_var.clamp_min(0), out_var)


def _tilted(
    mean: Tensor, cov: Tensor, eps: float, powers: tuple[float, ...]
) -> tuple[Tensor, dict[float, tuple[Tensor, Tensor, Tensor]]]:
    """``(U, {p: (E[a~ s^-p], E[a~ a~^T s^-p], E[s^-p])})`` in the eigenbasis of ``cov``."""
    d = mean.shape[-1]
    sym = 0.5 * (cov + cov.transpose(-1, -2))
    level = sym.diagonal(0, -2, -1).mean(-1, keepdim=True).detach()
    ramp = torch.arange(d, dtype=cov.dtype, device=cov.device) / d
    lam, vec = torch.linalg.eigh(sym + torch.diag_embed(1e-7 * level * ramp))
    lam = lam.clamp_min(0)
    mt = (vec.transpose(-1, -2) @ mean.unsqueeze(-1)).squeeze(-1)
    s_bar = (mean * mean).mean(-1) + lam.sum(-1) / d + eps
    t, base = _grid(s_bar, eps, mean.dtype)
    q = flush(1 / (1 + 2 * (t / d).unsqueeze(-1) * lam))
    base = base + 0.5 * q.log().sum(-1) - (t / d) * (q * mt * mt).sum(-1)
    qm = q * mt
    parts = {}
    for p in powers:
        w = _weights(base, t, p)
        first = (w.unsqueeze(-1) * qm).sum(0)
        second = torch.diag_embed((w.unsqueeze(-1) * q * lam).sum(0))
        qm_b = qm.movedim(0, -1)
        second = second + (qm_b * w.movedim(0, -1).unsqueeze(-2)) @ qm_b.transpose(-1, -2)
        parts[p] = (first, second, w.sum(0))
    return vec, parts


def rms_normalize_diag(mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of :math:`y = a/\sqrt{\lVert a\rVert^2/D + \epsilon}` over the last dim.

    :math:`a \sim \mathcal N(\mu, \operatorname{diag}(v))`: the exact route (independent
    coordinates under the tilt) or the tight form; computed in float64.

    Args:
        mean: :math:`\mu` ``[..., D]``.
        var: :math:`v \ge 0` ``[..., D]``.
        eps: :math:`\epsilon > 0`.

    Returns:
        ``(mean, var)``, each ``[..., D]`` (marginals; the output units are correlated).
    """
    out_mean, out_var = _rms_diag(mean.double(), var.double(), eps)
    return flush(out_mean.to(mean.dtype)), flush(out_var.to(mean.dtype))


def rms_normalize_full(mean: Tensor, cov: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    r"""Mean ``[..., D]`` and covariance ``[..., D, D]`` of :math:`y` for any input covariance."""
    m, c = mean.double(), cov.double()
    vec, parts = _tilted(m, c, eps, (0.5, 1.0))
    ey = (vec @ parts[0.5][0].unsqueeze(-1)).squeeze(-1)
    ey2 = vec @ parts[1.0][1] @ vec.transpose(-1, -2)
    out = ey2 - ey.unsqueeze(-1) * ey.unsqueeze(-2)
    mh, _, jac = _linear(m, eps)
    tight = _tight(c.diagonal(0, -2, -1).sum(-1), m, eps)
    out_mean = torch.where(tight.unsqueeze(-1), mh, ey)
    out_cov = torch.where(tight[..., None, None], jac @ c @ jac, out)
    out_cov = 0.5 * (out_cov + out_cov.transpose(-1, -2))
    return flush(out_mean.to(mean.dtype)), flush(out_cov.to(mean.dtype))


def rms_normalize_jacobian(mean: Tensor, cov: Tensor, eps: float) -> Tensor:
    r""":math:`E[\nabla_a y]` ``[..., D, D]``: :math:`\operatorname{Cov}(r, y) = \operatorname{Cov}(r, a)E[\nabla y]^\top`."""
    m, c = mean.double(), cov.double()
    d = m.shape[-1]
    vec, parts = _tilted(m, c, eps, (0.5, 1.5))
    e_half = parts[0.5][2]
    inner = vec @ parts[1.5][1] @ vec.transpose(-1, -2)
    eye = torch.eye(d, dtype=m.dtype, device=m.device)
    exact = e_half[..., None, None] * eye - inner / d
    _, _, jac = _linear(m, eps)
    tight = _tight(c.diagonal(0, -2, -1).sum(-1), m, eps)
    return flush(torch.where(tight[..., None, None], jac, exact).to(mean.dtype))
