r"""Moments of layer normalization of a Gaussian vector (LayerNorm, GroupNorm).

For :math:`a \sim \mathcal N(\mu, \Sigma)` in :math:`\mathbb R^D`, layer normalization (before
its affine part) is

.. math::
    y = \frac{z}{\sqrt s},\qquad z = Ca,\quad C = I - \tfrac1D\mathbf 1\mathbf 1^\top,\quad
    s = \tfrac1D\lVert z\rVert^2 + \epsilon .

**The exact route (default).** The centred vector is exactly Gaussian,
:math:`z \sim \mathcal N(m, S)` with :math:`m = C\mu`, :math:`S = C\Sigma C`, and the powers
of :math:`s` are Laplace transforms, :math:`s^{-p} = \Gamma(p)^{-1}\int_0^\infty t^{p-1}
e^{-ts}\,dt`. Under the exponential tilt :math:`e^{-t\lVert z\rVert^2/D}` a Gaussian stays
Gaussian: with :math:`\tau = t/D` and the eigendecomposition :math:`S = U\Lambda U^\top`,
:math:`\tilde m = U^\top m`, :math:`q_k = 1/(1 + 2\tau\lambda_k)`,

.. math::
    E\big[g(z)\,e^{-\tau\lVert z\rVert^2}\big] = Z(\tau)\,E_\tau[g(z)],\qquad
    \log Z(\tau) = \tfrac12\textstyle\sum_k \log q_k - \tau\sum_k q_k\tilde m_k^2,

where under :math:`E_\tau` the coordinates :math:`U^\top z` are independent
:math:`\mathcal N(q_k\tilde m_k, q_k\lambda_k)`. Hence

.. math::
    E[y] = \frac{1}{\Gamma(\frac12)}\int_0^\infty t^{-1/2} e^{-t\epsilon} Z\,U(q\circ\tilde m)\,dt,
    \qquad
    E[yy^\top] = \int_0^\infty e^{-t\epsilon} Z\,U\big(\operatorname{diag}(q\lambda) +
        (q\circ\tilde m)(q\circ\tilde m)^\top\big)U^\top dt,

one-dimensional integrals, computed by a double-exponential (tanh-sinh type) trapezoid rule in
:math:`\log t`, :math:`t = e^{\frac\pi2\sinh x}/\bar s` with :math:`\bar s = E[s]`, on
``x in [-4, 4]`` with step 0.1 (81 nodes; against a rule of twice the nodes and range the
differences are below 1e-9 in the means and 5e-9 in the variances for ``D >= 4``,
6e-7 in a variance for ``D = 2``). Up to that quadrature these moments are **exact**:
no approximation of the distribution of :math:`s`. For a *diagonal* :math:`\Sigma =
\operatorname{diag}(v)` no eigendecomposition is needed: the tilted precision
:math:`\operatorname{diag}(1/v) + 2\tau C` is a diagonal minus a rank-one matrix, and with
:math:`q_i = 1/(1 + 2\tau v_i)`, :math:`w_i = v_iq_i`, :math:`r_i = 1 - q_i`,
:math:`\bar m_q = \sum_i q_im_i/\sum_i q_i` (Sherman–Morrison and the matrix determinant
lemma)

.. math::
    \log Z = \tfrac12\textstyle\sum_i\log q_i - \tfrac12\log\big(\tfrac1D\sum_i q_i\big)
        - \tau\sum_i q_i(m_i - \bar m_q)^2,\quad
    E_\tau[z] = C\big(q\circ(m - \bar m_q)\big),\quad
    \operatorname{Cov}_\tau(a) = \operatorname{diag}(w) + \frac{w r^\top}{\sum_i q_i},

so the diag form costs :math:`O(D)` per node (the full form :math:`O(D^3)` once, for the
eigendecomposition).

**The tight form.** Where the input variance is small against the spread of the means,
:math:`\rho = \operatorname{tr}S / (\lVert m\rVert^2 + D\epsilon)` below :data:`TIGHT_RATIO`
(:math:`10^{-6}`), the variance :math:`E[yy^\top] - E[y]E[y]^\top` would cancel to rounding
error, and the first-order expansion of :math:`y` around :math:`\mu` takes over: with
:math:`s_0 = \lVert m\rVert^2/D + \epsilon` and :math:`\hat m = m/\sqrt{s_0}`,

.. math::
    y \approx \hat m + J(a - \mu),\qquad
    J = \frac{1}{\sqrt{s_0}}\Big(C - \frac{\hat m\hat m^\top}{D}\Big),\qquad
    E[y] \approx \hat m,\quad \operatorname{Cov}(y) \approx J\Sigma J

(:math:`J` is symmetric since :math:`C\hat m = \hat m`). It captures what a plug-in of the
statistics misses (the fluctuation of :math:`a` along :math:`m` and along :math:`\mathbf 1`
is normalized away), with error :math:`O(\rho)` in large widths; in small widths it is worse
(against the exact route: :math:`D = 4`, :math:`\rho \approx 10^{-3}`: variances off by up
to 30 %; :math:`D = 256`: 0.1 %, means off by 2e-3), which is why the exact route, computed
in float64 (the cancellation then costs :math:`10^{-16}/\rho` relative), runs down to
:math:`\rho = 10^{-6}`.

**Skip connections** need :math:`\operatorname{Cov}(r, y)` for an :math:`r` jointly Gaussian with
:math:`a`; by Stein's lemma it is :math:`\operatorname{Cov}(r, a)\,E[\nabla y]^\top` exactly,
with :math:`E[\nabla y] = \big(E[s^{-1/2}]I - \tfrac1D E[zz^\top s^{-3/2}]\big)C`, by the same
integrals with :math:`p = 1/2, 3/2` (:func:`normalize_jacobian`; :math:`J` in the tight form).

Measured against Monte Carlo in ``docs/moments.md`` ("Normalization layers").
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from . import policy
from ._quadrature import constant, fixed_rule
from .special import flush

__all__ = [
    "ROUTES",
    "LayerNormRoute",
    "layer_norm_first_order_diag",
    "normalize_cross_diag",
    "normalize_diag",
    "normalize_diag_with_slope",
    "normalize_full",
    "normalize_jacobian",
]

TIGHT_RATIO = 1e-6
"""Below this input-variance/spread ratio :math:`\\rho` the tight (linearized) form is used."""
_STEP = 0.1
_RANGE = 4.0


@fixed_rule
def _rule(_: int) -> tuple[Tensor, Tensor]:
    """``(u, log dt/T)`` of the double-exponential rule in float64 (computed untraced, once)."""
    x = torch.arange(-_RANGE, _RANGE + _STEP / 2, _STEP, dtype=torch.float64)
    u = math.pi / 2 * torch.sinh(x)
    log_dt = torch.log(_STEP * math.pi / 2 * torch.cosh(x)) + u
    return u, log_dt


def _nodes(dtype: torch.dtype, device: torch.device) -> tuple[Tensor, Tensor]:
    """``(u, log dt/T)`` of the double-exponential rule: ``t = T e^u``, ``u = pi/2 sinh x``.

    The float64 values are Python floats computed once outside any tracing (no cache holds a
    tracer's tensor); the tensors are :func:`~._quadrature.constant`.
    """
    u, log_dt = _rule(0)
    return constant(u, dtype, device), constant(log_dt, dtype, device)


def _centre(x: Tensor) -> Tensor:
    return x - x.mean(-1, keepdim=True)


def _grid(s_bar: Tensor, eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Nodes ``t [Q, ...]`` and ``log(dt) - t eps [Q, ...]`` for a batch of ``E[s]``."""
    u, log_dt = _nodes(dtype, s_bar.device)
    shape = (-1,) + (1,) * s_bar.dim()
    log_t = u.view(shape) - s_bar.detach().log()  # a fixed grid: gradients flow through Z
    t = log_t.exp()
    return t, log_dt.view(shape) - s_bar.detach().log() - t * eps


def _weights(base: Tensor, t: Tensor, p: float) -> Tensor:
    r"""Node weights of :math:`\Gamma(p)^{-1}\int t^{p-1}(\cdot)\,dt` (flushed, no subnormals)."""
    return flush(torch.exp(base + (p - 1) * t.log() - math.lgamma(p)))


def _tight_ratio(trace: Tensor, m: Tensor, eps: float) -> Tensor:
    d = m.shape[-1]
    return trace / ((m * m).sum(-1) + d * eps)


def _traced() -> bool:
    """Whether a tracer (``torch.compile``, ``torch.export``, ``torch.jit.trace``) runs the call."""
    return bool(policy.tracing() or torch.compiler.is_exporting() or torch.jit.is_tracing())


_Parts3 = tuple[Tensor, Tensor, Tensor]


def _exact_diag(mean: Tensor, var: Tensor, eps: float) -> _Parts3:
    """``(E[y], Var(y), E[dy_i/da_i])`` by the rank-one tilt and the quadrature (float64 inputs)."""
    d = mean.shape[-1]
    m = _centre(mean)
    trace = var.sum(-1) * (1 - 1 / d)
    s_bar = (m * m).mean(-1) + trace / d + eps
    t, base = _grid(s_bar, eps, mean.dtype)
    tau = (t / d).unsqueeze(-1)  # [Q, ..., 1]
    q = flush(1 / (1 + 2 * tau * var))
    w = var * q
    sq = q.sum(-1, keepdim=True)
    dm = m - (q * m).sum(-1, keepdim=True) / sq
    log_z = 0.5 * q.log().sum(-1) - 0.5 * (sq.squeeze(-1) / d).log()
    log_z = log_z - tau.squeeze(-1) * (q * dm * dm).sum(-1)
    m_t = _centre(q * dm)
    sr, sw = (1 - q).sum(-1, keepdim=True), w.sum(-1, keepdim=True)
    var_t = w + w * (1 - q) / sq - 2 * (w + w * sr / sq) / d + (sw + sw * sr / sq) / d**2
    base = base + log_z
    w_half, w_one = _weights(base, t, 0.5).unsqueeze(-1), _weights(base, t, 1.0).unsqueeze(-1)
    ey = (w_half * m_t).sum(0)
    ey2 = (w_one * (var_t + m_t * m_t)).sum(0)
    out_var = (ey2 - ey * ey).clamp_min(0)
    # E[dy_i/da_i] = (1 - 1/D) E[s^-1/2] - E[z_i^2 s^-3/2] / D
    w_3half = _weights(base, t, 1.5)
    slope = (1 - 1 / d) * w_half.squeeze(-1).sum(0).unsqueeze(-1)
    slope = slope - (w_3half.unsqueeze(-1) * (var_t + m_t * m_t)).sum(0) / d
    return ey, out_var, slope


def _first_order_diag(mean: Tensor, var: Tensor, eps: float) -> _Parts3:
    r"""``(m^, diag(J diag(v) J), diag(J))`` of the first-order form (module docstring), O(D)."""
    d = mean.shape[-1]
    m = _centre(mean)
    s0 = (m * m).mean(-1, keepdim=True) + eps
    mh = m / s0.sqrt()
    mv = (mh * var).sum(-1, keepdim=True)
    m2v = (mh * mh * var).sum(-1, keepdim=True)
    lin_var = (
        var
        - 2 * (1 + mh * mh) * var / d
        + (var.sum(-1, keepdim=True) + 2 * mh * mv + mh * mh * m2v) / d**2
    ) / s0
    return mh, lin_var.clamp_min(0), (1 - 1 / d - mh * mh / d) / s0.sqrt()


def _is_tight(mean: Tensor, var: Tensor, eps: float) -> Tensor:
    """``rho < TIGHT_RATIO`` per normalized vector ``[...]`` (diagonal input covariance)."""
    d = mean.shape[-1]
    return _tight_ratio(var.sum(-1) * (1 - 1 / d), _centre(mean), eps) < TIGHT_RATIO


LayerNormRoute = Literal["auto", "first_order"]
"""How a diag normalization is computed: ``"auto"``, the exact route unless the input variance is
negligible (:data:`TIGHT_RATIO`); ``"first_order"``, the first-order form everywhere."""
ROUTES: tuple[LayerNormRoute, ...] = ("auto", "first_order")


def _check_route(route: str) -> None:
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")


def _routed(
    exact: Callable[..., tuple[Tensor, ...]],
    first_order: Callable[..., tuple[Tensor, ...]],
    args: tuple[Tensor, ...],
    tight: Tensor,
    route: str,
) -> tuple[Tensor, ...]:
    """The execution policy: each vector by the route it needs, and only that one computed.

    ``args`` are ``[..., *]`` tensors sharing the leading shape of ``tight`` ``[...]``.
    ``"first_order"`` computes only the first-order form. ``"auto"`` decides per tensor first:
    all vectors tight, the first-order form alone; none, the exact route alone; a mix, each
    route on its own vectors (boolean indexing, eager mode). A traced call cannot branch on
    values, so it computes both routes on every vector and selects (``torch.where``).
    """
    _check_route(route)
    if route == "first_order":
        return first_order(*args)
    if _traced():
        both = zip(exact(*args), first_order(*args), strict=True)
        out = []
        for e, f in both:
            mask = tight.reshape(tight.shape + (1,) * (e.dim() - tight.dim()))
            out.append(torch.where(mask, f.to(e.dtype), e))
        return tuple(out)
    n_tight = int(tight.sum())
    if n_tight == 0:
        return exact(*args)
    if n_tight == tight.numel():
        return first_order(*args)
    exact_part = exact(*(a[~tight] for a in args))
    first_part = first_order(*(a[tight] for a in args))
    out = []
    for e, f in zip(exact_part, first_part, strict=True):
        whole = e.new_zeros(tight.shape + e.shape[1:])
        whole[~tight] = e
        whole[tight] = f.to(e.dtype)
        out.append(whole)
    return tuple(out)


def _normalize_diag(
    mean: Tensor, var: Tensor, eps: float, route: str = "auto"
) -> tuple[Tensor, Tensor, Tensor]:
    """The body of :func:`normalize_diag_with_slope`: the exact route in float64, or the first-order form."""

    def exact(mu: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        return _exact_diag(mu.double(), v.double(), eps)

    def first(mu: Tensor, v: Tensor) -> tuple[Tensor, ...]:
        return _first_order_diag(mu, v, eps)

    tight = _is_tight(mean.detach(), var.detach(), eps) if route == "auto" else mean.new_ones(())
    out_mean, out_var, slope = _routed(exact, first, (mean, var), tight, route)
    return out_mean, out_var, slope


_JITTER = 1e-7


def _eigen(cov: Tensor) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at zero) and eigenvectors of the centred covariance ``C cov C``.

    Equal eigenvalues (an isotropic covariance, equal variances) make the gradient of
    ``eigh`` divide zero by zero; a fixed spread of ``1e-7`` times the mean variance on the
    diagonal separates them, which moves the moments by about 1e-7 relative and keeps the
    gradients finite (and within about 1e-6 of the diag route's).
    """
    d = cov.shape[-1]
    s = _centre(_centre(cov).transpose(-1, -2))
    s = 0.5 * (s + s.transpose(-1, -2))
    level = torch.diagonal(s, 0, -2, -1).mean(-1, keepdim=True).detach()
    ramp = torch.arange(d, dtype=cov.dtype, device=cov.device) / d
    lam, vec = torch.linalg.eigh(s + torch.diag_embed(_JITTER * level * ramp))
    return lam.clamp_min(0), vec


_Parts = dict[float, tuple[Tensor, Tensor, Tensor]]


def _tilted(
    mean: Tensor, cov: Tensor, eps: float, powers: tuple[float, ...]
) -> tuple[Tensor, Tensor, _Parts]:
    r"""``(U, m, {p: (E[z~ s^-p], E[z~ z~^T s^-p], E[s^-p])})`` with ``z~ = U^T z``."""
    d = mean.shape[-1]
    m = _centre(mean)
    lam, vec = _eigen(cov)
    mt = (vec.transpose(-1, -2) @ m.unsqueeze(-1)).squeeze(-1)  # U^T m
    s_bar = (m * m).mean(-1) + lam.sum(-1) / d + eps
    t, base = _grid(s_bar, eps, mean.dtype)
    q = flush(1 / (1 + 2 * (t / d).unsqueeze(-1) * lam))  # [Q, ..., D]
    base = base + 0.5 * q.log().sum(-1) - (t / d) * (q * mt * mt).sum(-1)
    qm = q * mt
    parts: _Parts = {}
    for p in powers:
        w = _weights(base, t, p)  # [Q, ...]
        first = (w.unsqueeze(-1) * qm).sum(0)
        second = torch.diag_embed((w.unsqueeze(-1) * q * lam).sum(0))
        # sum_q w_q (q m~)(q m~)^T as one product over the nodes
        qm_batch = qm.movedim(0, -1)  # [..., D, Q]
        second = second + (qm_batch * w.movedim(0, -1).unsqueeze(-2)) @ qm_batch.transpose(-1, -2)
        parts[p] = (first, second, w.sum(0))
    return vec, m, parts


def _linear_jacobian(m: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(m / sqrt(s0), J)`` of the tight form; ``J`` ``[..., D, D]`` is symmetric."""
    d = m.shape[-1]
    s0 = (m * m).mean(-1, keepdim=True) + eps
    mh = m / s0.sqrt()
    eye = torch.eye(d, dtype=m.dtype, device=m.device)
    jac = (eye - 1 / d - mh.unsqueeze(-1) * mh.unsqueeze(-2) / d) / s0.sqrt().unsqueeze(-1)
    return mh, jac


def _exact_full(mean: Tensor, cov: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(E[y], Cov(y))`` by the eigendecomposition and the quadrature (float64 inputs)."""
    vec, _, parts = _tilted(mean, cov, eps, (0.5, 1.0))
    first, second = parts[0.5][0], parts[1.0][1]
    ey = (vec @ first.unsqueeze(-1)).squeeze(-1)
    ey2 = vec @ second @ vec.transpose(-1, -2)
    return ey, ey2 - ey.unsqueeze(-1) * ey.unsqueeze(-2)


def _first_order_full(mean: Tensor, cov: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(m^, J cov J)`` of the first-order form."""
    mh, jac = _linear_jacobian(_centre(mean), eps)
    return mh, jac @ cov @ jac


def _is_tight_full(mean: Tensor, cov: Tensor, eps: float) -> Tensor:
    trace = torch.diagonal(cov, 0, -2, -1).sum(-1) - cov.sum((-2, -1)) / mean.shape[-1]
    return _tight_ratio(trace, _centre(mean), eps) < TIGHT_RATIO


def _normalize_full(
    mean: Tensor, cov: Tensor, eps: float, route: str = "auto"
) -> tuple[Tensor, Tensor]:
    """The body of :func:`normalize_full` (float64 inputs)."""
    tight = _is_tight_full(mean.detach(), cov.detach(), eps) if route == "auto" else mean
    mean_out, cov_out = _routed(
        lambda mu, c: _exact_full(mu, c, eps),
        lambda mu, c: _first_order_full(mu, c, eps),
        (mean, cov),
        tight,
        route,
    )
    return mean_out, 0.5 * (cov_out + cov_out.transpose(-1, -2))


def _exact_jacobian(mean: Tensor, cov: Tensor, eps: float) -> Tensor:
    """``E[grad y]`` ``[..., D, D]`` by the eigendecomposition and the quadrature (float64)."""
    d = mean.shape[-1]
    vec, _, parts = _tilted(mean, cov, eps, (0.5, 1.5))
    e_half, second = parts[0.5][2], parts[1.5][1]
    inner = vec @ second @ vec.transpose(-1, -2)
    eye = torch.eye(d, dtype=mean.dtype, device=mean.device)
    exact = e_half.unsqueeze(-1).unsqueeze(-1) * eye - inner / d
    return exact - exact.mean(-1, keepdim=True)  # (.) C


def _normalize_jacobian(mean: Tensor, cov: Tensor, eps: float, route: str = "auto") -> Tensor:
    """The body of :func:`normalize_jacobian` (float64 inputs)."""
    tight = _is_tight_full(mean.detach(), cov.detach(), eps) if route == "auto" else mean
    (jac,) = _routed(
        lambda mu, c: (_exact_jacobian(mu, c, eps),),
        lambda mu, _: (_linear_jacobian(_centre(mu), eps)[1],),
        (mean, cov),
        tight,
        route,
    )
    return jac


def _exact_jacobian_diag(mean: Tensor, var: Tensor, eps: float) -> Tensor:
    r"""``E[grad y]`` ``[..., D, D]`` for a diagonal input covariance, without an eigendecomposition.

    Under the tilt (module docstring) :math:`E_\tau[zz^\top] = C\operatorname{Cov}_\tau(a)C +
    E_\tau[z]E_\tau[z]^\top` with :math:`\operatorname{Cov}_\tau(a) = \operatorname{diag}(w) +
    wr^\top/\sum_i q_i`, so :math:`E[zz^\top s^{-3/2}] = C\big(\operatorname{diag}(\sum_k
    \omega_kw_k) + UV^\top\big)C + \sum_k\omega_k E_{\tau_k}[z]E_{\tau_k}[z]^\top`, products over
    the :math:`Q` nodes (:math:`O(QD^2)` per vector, float64 inputs).
    """
    d = mean.shape[-1]
    m = _centre(mean)
    trace = var.sum(-1) * (1 - 1 / d)
    s_bar = (m * m).mean(-1) + trace / d + eps
    t, base = _grid(s_bar, eps, mean.dtype)
    tau = (t / d).unsqueeze(-1)
    q = flush(1 / (1 + 2 * tau * var))  # [Q, ..., D]
    w = var * q
    sq = q.sum(-1, keepdim=True)
    dm = m - (q * m).sum(-1, keepdim=True) / sq
    log_z = 0.5 * q.log().sum(-1) - 0.5 * (sq.squeeze(-1) / d).log()
    base = base + log_z - tau.squeeze(-1) * (q * dm * dm).sum(-1)
    m_t = _centre(q * dm)  # E_tau[z]
    e_half = _weights(base, t, 0.5).sum(0)  # E[s^-1/2]
    omega = _weights(base, t, 1.5).unsqueeze(-1)  # [Q, ..., 1]
    u = (omega * w / sq).movedim(0, -1)  # [..., D, Q]
    v = (1 - q).movedim(0, -1)
    mq = m_t.movedim(0, -1)
    tilted = torch.diag_embed((omega * w).sum(0)) + u @ v.transpose(-1, -2)
    tilted = _centre(_centre(tilted).transpose(-1, -2))  # C (.) C
    second = tilted + (mq * omega.movedim(0, -1)) @ mq.transpose(-1, -2)
    eye = torch.eye(d, dtype=mean.dtype, device=mean.device)
    jac = e_half.unsqueeze(-1).unsqueeze(-1) * eye - second / d
    return jac - jac.mean(-1, keepdim=True)  # (.) C


def _cross_exact_diag(cross: Tensor, mean: Tensor, var: Tensor, eps: float) -> tuple[Tensor]:
    jac = _exact_jacobian_diag(mean.double(), var.double(), eps)
    return ((cross.double() @ jac.transpose(-1, -2)).to(cross.dtype),)


def _cross_first_order(cross: Tensor, mean: Tensor, eps: float) -> tuple[Tensor]:
    r"""``cross @ J`` with :math:`J = (C - \hat m\hat m^\top/D)/\sqrt{s_0}` applied, not built."""
    d = mean.shape[-1]
    m = _centre(mean)
    s0 = (m * m).mean(-1, keepdim=True) + eps
    mh = m / s0.sqrt()
    along = (cross @ mh.unsqueeze(-1)) * mh.unsqueeze(-2) / d  # (cross m^) m^T / D
    return ((_centre(cross) - along) / s0.sqrt().unsqueeze(-1),)


def _wide(x: Tensor, second: Tensor) -> tuple[Tensor, Tensor]:
    return x.double(), second.double()


def normalize_diag(
    mean: Tensor, var: Tensor, eps: float = 1e-5, route: LayerNormRoute = "auto"
) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of :math:`y = Ca/\sqrt{\lVert Ca\rVert^2/D + \epsilon}` over the last dim.

    :math:`a \sim \mathcal N(\mu, \operatorname{diag}(v))` (independent units): the exact
    route by the rank-one tilt (computed in float64, since the variance is a difference of
    second moments), or the first-order form (module docstring); returned in the input's dtype.

    Args:
        mean: :math:`\mu` ``[..., D]``.
        var: :math:`v \ge 0` ``[..., D]``.
        eps: :math:`\epsilon > 0`.
        route: ``"auto"`` (the exact route unless :math:`\rho <` :data:`TIGHT_RATIO`, decided
            per tensor before anything is computed) or ``"first_order"`` (the first-order form
            for every vector, :math:`O(D)` per vector, in the input's dtype).

    Returns:
        ``(mean, var)`` of :math:`y`, each ``[..., D]`` (the output units are correlated; these
        are their marginals).
    """
    out_mean, out_var, _ = _normalize_diag(mean, var, eps, route)
    return flush(out_mean.to(mean.dtype)), flush(out_var.to(mean.dtype))


def layer_norm_first_order_diag(
    mean: Tensor,
    var: Tensor,
    eps: float = 1e-5,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""LayerNorm's first-order form and its affine part in one pass, over the last dim.

    The same moments as :func:`normalize_diag` with ``route="first_order"`` followed by the
    affine map :math:`\gamma y + \beta`, with fewer operations (a transformer's predictive runs
    it three times per block): :math:`\hat m = (\mu - \bar\mu)/\sqrt{s_0}`,
    :math:`s_0 = \overline{(\mu - \bar\mu)^2} + \epsilon` by ``torch.native_layer_norm``,
    then

    .. math::
        \operatorname{Var}(y_i) = \frac{\gamma_i^2}{s_0}\Big(v_i - \frac2D(1 + \hat m_i^2)v_i
            + \frac{1}{D^2}\big(\textstyle\sum_j v_j + 2\hat m_i\sum_j\hat m_jv_j
            + \hat m_i^2\sum_j\hat m_j^2v_j\big)\Big),

    the diagonal of :math:`J\operatorname{diag}(v)J^\top` with
    :math:`J = (I - \frac1D\mathbf 1\mathbf 1^\top - \frac1D\hat m\hat m^\top)/\sqrt{s_0}`
    (module docstring), and :math:`E[y] = \gamma\hat m + \beta`. Differentiable by autograd.

    Args:
        mean: :math:`\mu` ``[..., D]``.
        var: :math:`v \ge 0` ``[..., D]``.
        eps: :math:`\epsilon > 0`.
        weight: :math:`\gamma` ``[D]`` or ``None`` (1).
        bias: :math:`\beta` ``[D]`` or ``None`` (0).

    Returns:
        ``(mean, var)``, each ``[..., D]``, in the input's dtype.
    """
    d = mean.shape[-1]
    mh, _, rstd = torch.native_layer_norm(mean, (d,), None, None, eps)
    mhv = mh * var
    mh2v = mhv * mh
    sums = torch.stack([var, mhv, mh2v]).sum(-1, keepdim=True)  # [3, ..., 1]
    # sum v + m^ (2 sum m^v + m^ sum m^2v): the three shared terms in two operations
    shared = torch.addcmul(sums[0], mh, torch.addcmul(sums[1], mh, sums[2], value=0.5), value=2)
    own = torch.add(var, mh2v, alpha=1.0).mul(-2.0 / d).add(var)
    out_var = torch.add(own, shared, alpha=1.0 / d**2) * (rstd * rstd)
    if weight is not None:
        out_var = out_var * (weight * weight)
        out_mean = mh * weight if bias is None else torch.addcmul(bias, mh, weight)
    else:
        out_mean = mh if bias is None else mh + bias
    return out_mean, flush(out_var.clamp_min(0))


def normalize_diag_with_slope(
    mean: Tensor, var: Tensor, eps: float = 1e-5, route: LayerNormRoute = "auto"
) -> tuple[Tensor, Tensor, Tensor]:
    r""":func:`normalize_diag` and the expected self-derivative :math:`E[\partial y_i/\partial a_i]`.

    By Stein's lemma :math:`\operatorname{Cov}(r, y_i) = \operatorname{Cov}(r, a_i)\,
    E[\partial y_i/\partial a_i]` for an :math:`r` jointly Gaussian with :math:`a_i` and
    independent of the other units (a skip connection across batch normalization, whose
    "units" are the examples of a batch), with

    .. math::
        E[\partial y_i/\partial a_i] = (1 - \tfrac1D)\,E[s^{-1/2}] - \tfrac1D E[z_i^2 s^{-3/2}]

    (the diagonal of :func:`normalize_jacobian` for a diagonal :math:`\Sigma`), by the same
    quadrature (:math:`p = 1/2, 3/2`), or :math:`(1 - \frac1D - \hat m_i^2/D)/\sqrt{s_0}` in the
    first-order form.

    Args:
        mean: :math:`\mu` ``[..., D]``.
        var: :math:`v \ge 0` ``[..., D]``.
        eps: :math:`\epsilon > 0`.
        route: as :func:`normalize_diag`.

    Returns:
        ``(mean, var, slope)``, each ``[..., D]``.
    """
    out_mean, out_var, slope = _normalize_diag(mean, var, eps, route)
    dtype = mean.dtype
    return flush(out_mean.to(dtype)), flush(out_var.to(dtype)), flush(slope.to(dtype))


def normalize_full(
    mean: Tensor, cov: Tensor, eps: float = 1e-5, route: LayerNormRoute = "auto"
) -> tuple[Tensor, Tensor]:
    r"""Mean and covariance of :math:`y = Ca/\sqrt{\lVert Ca\rVert^2/D + \epsilon}`.

    :math:`a \sim \mathcal N(\mu, \Sigma)` with any covariance: the exact route through the
    eigendecomposition of :math:`C\Sigma C`, or the first-order form (module docstring);
    computed in float64.

    Args:
        mean: :math:`\mu` ``[..., D]``.
        cov: :math:`\Sigma` ``[..., D, D]``.
        eps: :math:`\epsilon > 0`.
        route: as :func:`normalize_diag` (``"first_order"``: :math:`J\Sigma J`, no
            eigendecomposition).

    Returns:
        ``(mean [..., D], cov [..., D, D])`` of :math:`y`.
    """
    out_mean, out_cov = _normalize_full(*_wide(mean, cov), eps, route)
    return flush(out_mean.to(mean.dtype)), flush(out_cov.to(mean.dtype))


def normalize_jacobian(
    mean: Tensor, cov: Tensor, eps: float = 1e-5, route: LayerNormRoute = "auto"
) -> Tensor:
    r""":math:`E[\nabla_a y]` ``[..., D, D]``, which maps :math:`\operatorname{Cov}(r, a)` to :math:`\operatorname{Cov}(r, y)`.

    Stein's lemma (exact for :math:`r, a` jointly Gaussian):
    :math:`\operatorname{Cov}(r, y) = \operatorname{Cov}(r, a)\,E[\nabla y]^\top` with
    :math:`E[\nabla y] = \big(E[s^{-1/2}]I - \tfrac1D E[zz^\top s^{-3/2}]\big)C`; :math:`J` of
    the first-order form where :math:`\rho` is below :data:`TIGHT_RATIO` or ``route`` is
    ``"first_order"``. For a diagonal :math:`\Sigma`, :func:`normalize_cross_diag` applies it
    without an eigendecomposition.
    """
    return flush(_normalize_jacobian(*_wide(mean, cov), eps, route).to(mean.dtype))


def normalize_cross_diag(
    cross: Tensor, mean: Tensor, var: Tensor, eps: float = 1e-5, route: LayerNormRoute = "auto"
) -> Tensor:
    r""":math:`\operatorname{Cov}(r, y) = \operatorname{Cov}(r, a)\,E[\nabla_a y]^\top` for :math:`a \sim \mathcal N(\mu, \operatorname{diag}(v))`.

    The same :math:`E[\nabla y]` as :func:`normalize_jacobian` at
    :math:`\Sigma = \operatorname{diag}(v)`, without an eigendecomposition: the exact route
    sums the tilted second moments over the quadrature nodes (:math:`O(QD^2)` per vector, in
    float64); the first-order form applies
    :math:`J = (C - \hat m\hat m^\top/D)/\sqrt{s_0}` to ``cross`` in :math:`O(D_rD)`
    without building it.

    Args:
        cross: :math:`\operatorname{Cov}(r, a)` ``[..., D_r, D]``.
        mean: :math:`\mu` ``[..., D]``.
        var: :math:`v \ge 0` ``[..., D]``.
        eps: :math:`\epsilon > 0`.
        route: as :func:`normalize_diag`.

    Returns:
        :math:`\operatorname{Cov}(r, y)` ``[..., D_r, D]``, in ``cross``'s dtype.
    """
    tight = _is_tight(mean.detach(), var.detach(), eps) if route == "auto" else mean
    (out,) = _routed(
        lambda c, mu, v: _cross_exact_diag(c, mu, v, eps),
        lambda c, mu, _: _cross_first_order(c, mu, eps),
        (cross, mean, var),
        tight,
        route,
    )
    return flush(out.to(cross.dtype))
