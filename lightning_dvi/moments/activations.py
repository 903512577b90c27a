r"""Moments of ReLU and Heaviside applied to a Gaussian vector (paper section 3.1, appendix A).

For :math:`a \sim \mathcal N(m, \Sigma)` and :math:`h = f(a)` elementwise, write
:math:`\sigma_j = \sqrt{\Sigma_{jj}}`, :math:`\mu_j = m_j/\sigma_j`,
:math:`\rho_{jl} = \Sigma_{jl}/(\sigma_j\sigma_l)` and :math:`\bar\rho = \sqrt{1-\rho^2}`.

**Exact (diagonal) terms.**

* ReLU: :math:`E[h_j] = \sigma_j SR(\mu_j)` with :math:`SR(x) = \phi(x) + x\Phi(x)`;
  :math:`E[h_j^2] = \Sigma_{jj}[\mu_j\phi(\mu_j) + (1+\mu_j^2)\Phi(\mu_j)]`.
* Heaviside: :math:`E[h_j] = \Phi(\mu_j)`, :math:`\operatorname{Var}(h_j) = \Phi(\mu_j)\Phi(-\mu_j)`.

**Off-diagonal approximation** :math:`E[h_j h_l] = S_{jl}\{A + e^{-Q}\}` with a quadratic
:math:`Q`. The forms below are the ones that match the exact second-order Taylor expansion of
the residual :math:`I - A` at :math:`\mu = 0` (derived again here and checked against quadrature
in the tests); they differ from the paper's Table 1 as printed:

* ReLU (:math:`S = \sigma_j\sigma_l`, :math:`A = SR(\mu_j)SR(\mu_l) + \rho\Phi(\mu_j)\Phi(\mu_l)`):
  :math:`e^{-Q} = \frac{\rho\, g_r}{2\pi}\exp\!\big[-\frac{\rho}{2 g_r (1+\bar\rho)}
  (\mu_j^2+\mu_l^2) + \frac{\arcsin\rho - \rho}{\rho\, g_r}\mu_j\mu_l\big]` with
  :math:`g_r = \arcsin\rho - \frac{\rho}{1+\bar\rho}` (the table prints ``+``) and the factor
  :math:`\rho` in the prefactor (the table puts it in the Heaviside row instead). Hence
  :math:`\operatorname{Cov}(h_j, h_l) = \Sigma_{jl}\Phi(\mu_j)\Phi(\mu_l) + \sigma_j\sigma_l e^{-Q}`.
* Heaviside (:math:`S = 1`, :math:`A = \Phi(\mu_j)\Phi(\mu_l)`):
  :math:`e^{-Q} = \frac{\arcsin\rho}{2\pi}\exp\!\big[-\frac{\rho}{2 g_h \bar\rho}(\mu_j^2+\mu_l^2)
  + \frac{\rho^2}{g_h\bar\rho(1+\bar\rho)}\mu_j\mu_l\big]` with :math:`g_h = \arcsin\rho` (the table
  prints :math:`\log(g_h\rho/2\pi)`), so :math:`\operatorname{Cov}(h_j, h_l) = e^{-Q}`.

The ReLU moments are evaluated by custom autograd functions with closed-form backward passes,
the full covariance by one formula executed block by block on its upper triangle on a CPU or
as whole-tensor (possibly compiled) kernels on a GPU (:mod:`._relu`, :mod:`._relu_cov`,
:mod:`.policy`);
the Heaviside coefficients through :func:`~lightning_dvi.moments.special.asin_over_x`, which is
smooth at :math:`\rho = 0` (the common case: a first layer fed a deterministic input has
diagonal output covariance), so values and gradients stay finite there.
"""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from . import policy
from ._relu import floors, relu_diag_fn
from ._relu_cov import _q_max, relu_cov
from .special import (
    asin_over_x,
    clip_correlation,
    flush,
    normal_cdf,
    normal_pdf,
)

__all__ = [
    "heaviside_cov",
    "heaviside_diag",
    "heaviside_full",
    "heaviside_slope",
    "min_variance",
    "relu_diag",
    "relu_full",
    "relu_slope",
    "soft_relu",
]

_TWO_PI = 2.0 * math.pi
# |mu| beyond this makes the correction exp(-Q) underflow to exactly 0 in any dtype (Q is a
# positive-definite quadratic with eigenvalues >= 0.37), so clamping there changes nothing but
# keeps mu^2 from overflowing float32 when a variance is tiny and a mean is huge.
_MU_CLAMP = 1e3


def min_variance(dtype: torch.dtype) -> float:
    """Deprecated: the variance floor, ``floors(dtype)[0]`` of :mod:`._relu` (its one home)."""
    warnings.warn(
        "lightning_dvi.moments.min_variance is deprecated and will be removed in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return floors(dtype)[0]


def _standardise(mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
    sd = var.clamp_min(floors(var.dtype)[0]).sqrt()
    return sd, mean / sd


# ---------------------------------------------------------------------------------- ReLU
def relu_diag(mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
    r"""Exact mean and variance of :math:`\max(0, a)` for :math:`a \sim \mathcal N(m, v)`.

    .. math::
        E[h] = m\Phi(\mu) + \sigma\phi(\mu),\qquad
        \operatorname{Var}(h) = \sigma^2\Phi(\mu) + m^2\Phi(\mu)\Phi(-\mu)
            + m\sigma\phi(\mu)[\Phi(-\mu) - \Phi(\mu)] - \sigma^2\phi(\mu)^2

    for :math:`\mu \ge 0`; for :math:`\mu < 0` the Mills-ratio form
    :math:`\sigma^2\phi[\mu + (1+\mu^2)R] - \sigma^2\phi^2(1 + \mu R)^2`,
    :math:`R = \Phi(\mu)/\phi(\mu)`, avoids cancelling two tiny numbers.

    Args:
        mean: :math:`m`, any shape.
        var: :math:`v \ge 0`, same shape.

    Returns:
        ``(mean, var)`` of the output, same shape.
    """
    return relu_diag_fn(mean, var)


def relu_slope(mean: Tensor, var: Tensor) -> Tensor:
    r""":math:`E[\mathrm{relu}'(a)] = \Phi(\mu)`, the slope used for skip connections.

    By Stein's lemma :math:`\operatorname{Cov}(x, \mathrm{relu}(a)) =
    \operatorname{Cov}(x, a)\,\Phi(\mu)` for jointly Gaussian :math:`(x, a)`.
    """
    _, mu = _standardise(mean, var)
    return normal_cdf(mu)


def relu_full(mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
    r"""Mean and covariance of :math:`\max(0, a)` for :math:`a \sim \mathcal N(m, \Sigma)`.

    Diagonal exact (:func:`relu_diag`), off-diagonal by the corrected asymptote-plus-correction
    form of the module docstring:
    :math:`\operatorname{Cov}(h_j,h_l) = \Sigma_{jl}\Phi_j\Phi_l + \sigma_j\sigma_l
    \frac{\rho^2 G}{2\pi}\exp[-\beta(\mu_j^2+\mu_l^2) + \gamma\mu_j\mu_l]` with
    :math:`G = g_r/\rho`, :math:`\beta = 1/(2G(1+\bar\rho))`, :math:`\gamma = \rho\,h(\rho)/G`,
    :math:`h(\rho) = (\arcsin\rho - \rho)/\rho^3`.

    The off-diagonal block is evaluated by :func:`._relu_cov.relu_cov` on the upper triangle,
    block by block, with a closed-form backward pass; :math:`\mu` is clamped to
    :math:`\pm 10^3`, beyond which the correction underflows to exactly zero anyway.

    Args:
        mean: ``[..., D]``.
        cov: ``[..., D, D]``, symmetric PSD.

    Returns:
        ``(mean [..., D], cov [..., D, D])``.
    """
    var = cov.diagonal(dim1=-2, dim2=-1)
    out_mean, out_var = relu_diag(mean, var)
    lead = torch.broadcast_shapes(mean.shape[:-1], cov.shape[:-2])
    mean, cov = mean.expand(*lead, mean.shape[-1]), cov.expand(*lead, *cov.shape[-2:])
    var = cov.diagonal(dim1=-2, dim2=-1)
    sd = var.clamp_min(floors(var.dtype)[0]).sqrt()
    mu = (mean / sd).clamp(-_MU_CLAMP, _MU_CLAMP)
    return out_mean, relu_cov(cov, sd, mu, normal_cdf(mu), out_var)


# ----------------------------------------------------------------------------- Heaviside
def heaviside_diag(mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
    r"""Exact mean :math:`\Phi(\mu)` and variance :math:`\Phi(\mu)\Phi(-\mu)` of :math:`H(a)`."""
    _, mu = _standardise(mean, var)
    cdf, cdf_neg = normal_cdf(mu), normal_cdf(-mu)
    return cdf, cdf * cdf_neg


def heaviside_slope(mean: Tensor, var: Tensor) -> Tensor:
    r""":math:`E[H'(a)] = E[\delta(a)] = \phi(\mu)/\sigma` (Stein's lemma, skip connections).

    The paper's appendix C prints :math:`\Sigma_{jj}^{-1}\phi(\mu_j)`; the density of :math:`a_j`
    at 0 is :math:`\phi(\mu_j)/\sigma_j`, which is what the tests check by Monte Carlo.
    """
    sd, mu = _standardise(mean, var)
    return flush(normal_pdf(mu) / sd)


def heaviside_full(mean: Tensor, cov: Tensor) -> tuple[Tensor, Tensor]:
    r"""Mean and covariance of :math:`H(a)` for :math:`a \sim \mathcal N(m, \Sigma)`.

    :math:`\operatorname{Cov}(h_j,h_l) = \frac{\arcsin\rho}{2\pi}
    \exp[-\beta(\mu_j^2+\mu_l^2) + \gamma\mu_j\mu_l]` with
    :math:`\beta = \frac{1}{2\bar\rho\,(\arcsin\rho/\rho)}` and
    :math:`\gamma = \frac{\rho}{\bar\rho(1+\bar\rho)(\arcsin\rho/\rho)}`; exact diagonal.
    """
    var = cov.diagonal(dim1=-2, dim2=-1)
    out_mean, out_var = heaviside_diag(mean, var)
    path = policy.resolve(cov.device)
    if path == "blocked":  # on a CPU the whole-tensor formula, unchunked, is the fast path
        return out_mean, heaviside_cov(mean, cov, out_var)
    lead = torch.broadcast_shapes(mean.shape[:-1], cov.shape[:-2])
    d = cov.shape[-1]
    flat = (
        mean.expand(*lead, d).reshape(-1, d),
        cov.expand(*lead, d, d).reshape(-1, d, d),
        out_var.expand(*lead, d).reshape(-1, d),
    )
    fn = policy.compiled("heaviside_cov", heaviside_cov) if path == "compiled" else heaviside_cov
    n = flat[1].shape[0]
    size = policy.chunk_size(n, d, cov.dtype, path)
    if size >= n:
        out = fn(*flat)
    else:
        # recompute each chunk in the backward instead of keeping every chunk's intermediates
        # (not while traced: the outer compiler decides what to keep or recompute)
        keep = policy.tracing() or not (
            torch.is_grad_enabled() and any(t.requires_grad for t in flat)
        )
        parts = [
            fn(*(t[a:b] for t in flat))
            if keep
            else checkpoint(fn, *(t[a:b] for t in flat), use_reentrant=False)
            for a, b in policy.chunks(n, size)
        ]
        out = torch.cat(parts)
    return out_mean, out.reshape(*lead, d, d)


def heaviside_cov(mean: Tensor, cov: Tensor, out_var: Tensor) -> Tensor:
    r"""The Heaviside output covariance of :func:`heaviside_full` as one whole-tensor formula.

    Args:
        mean: input means ``[..., D]``.
        cov: input covariance ``[..., D, D]``.
        out_var: the exact output variances ``[..., D]`` (the diagonal and the clamp bound).

    Returns:
        ``[..., D, D]``, symmetric, with ``out_var`` on the diagonal.
    """
    var = cov.diagonal(dim1=-2, dim2=-1)
    sd, mu = _standardise(mean, var)
    rho = clip_correlation(cov / (sd.unsqueeze(-1) * sd.unsqueeze(-2)))
    rho_bar = torch.sqrt(1 - rho * rho)
    aor = asin_over_x(rho)
    beta = 1 / (2 * aor * rho_bar)
    gamma = rho / (rho_bar * (1 + rho_bar) * aor)
    mu = mu.clamp(-_MU_CLAMP, _MU_CLAMP)
    mu_j, mu_l = mu.unsqueeze(-1), mu.unsqueeze(-2)
    quad = beta * (mu_j * mu_j + mu_l * mu_l) - gamma * mu_j * mu_l
    # e^{-Q} where it is above the tail cutoff, exactly 0 beyond (no underflowing exp)
    out_cov = rho * aor / _TWO_PI * flush(torch.exp(-quad.clamp(max=_q_max(quad.dtype))))
    return _with_diagonal(out_cov, out_var)


def _with_diagonal(cov: Tensor, diag: Tensor) -> Tensor:
    r"""Put the exact variances on the diagonal and enforce Cauchy-Schwarz off it.

    The true covariance satisfies :math:`|C_{jl}| \le \sqrt{C_{jj}C_{ll}}`; the quadratic-Q
    approximation can break it in the far tails (e.g. Heaviside at :math:`\mu = (13, -37)`,
    where both sides are ~1e-300), which would make the matrix indefinite. Clamping there only
    moves the approximation towards the truth.
    """
    # clamp before sqrt: an underflowed variance would give sqrt'(0) = inf -> NaN gradients
    sd = diag.clamp_min(torch.finfo(diag.dtype).tiny).sqrt()
    bound = sd.unsqueeze(-1) * sd.unsqueeze(-2)
    # fused multiply-adds in broadcast kernels round (j, l) and (l, j) differently
    cov = 0.5 * (cov + cov.transpose(-1, -2))
    cov = flush(torch.minimum(torch.maximum(cov, -bound), bound))
    return torch.diagonal_scatter(cov, diag, dim1=-2, dim2=-1)


def soft_relu(x: Tensor) -> Tensor:
    r"""Deprecated (unused): the paper's soft ReLU :math:`SR(x) = \phi(x) + x\Phi(x)`.

    It is the mean of :func:`lightning_dvi.moments.relu_diag` at unit variance, which is where
    the formula lives; removed in the next release.
    """
    warnings.warn(
        "lightning_dvi.moments.soft_relu is deprecated and will be removed in the next release; "
        "use relu_diag(x, torch.ones_like(x))[0]",
        DeprecationWarning,
        stacklevel=2,
    )
    return relu_diag(x, torch.ones_like(x))[0]
