r"""Moments of a linear layer whose weights have a *full-covariance* Gaussian posterior.

The weights and bias of the layer are stacked into :math:`\tilde W = [W, b]` (``[K, D + 1]``,
the ``torch.nn.Linear`` layout with the bias as a last column) and the posterior is one
Gaussian over :math:`\theta = \operatorname{vec}(\tilde W)` (row-major: index
:math:`(k, j) \mapsto k(D+1) + j`),

.. math::
    \theta \sim \mathcal N(\operatorname{vec} \tilde M,\ \Sigma),\qquad \Sigma = LL^\top,

with :math:`L` lower triangular ``[P, P]``, :math:`P = K(D+1)`. Write :math:`\Sigma_{kl}` for the
``[D+1, D+1]`` block of :math:`\Sigma` between output rows :math:`k` and :math:`l`, and
:math:`\tilde h = [h, 1]` for the input with a constant 1 appended. The output is
:math:`a = \tilde W \tilde h`.

**Deterministic input.** :math:`a` is exactly Gaussian, with

.. math::
    E[a_k] = \tilde M_k \tilde h,\qquad
    \operatorname{Cov}(a_k, a_l) = \tilde h^\top \Sigma_{kl} \tilde h
    = (U U^\top)_{kl},\quad U_{kr} = \textstyle\sum_j \tilde h_j L_{(k,j), r},

so the logits are correlated (unlike a factorised posterior, whose output units are independent).

**Gaussian input** :math:`h \sim \mathcal N(\mu, C)` independent of the weights. By the law of
total covariance, conditioning on :math:`h` (:math:`\tilde\mu = [\mu, 1]`, :math:`\tilde C` is
:math:`C` padded with a zero row and column for the constant):

.. math::
    E[a_k] &= \tilde M_k \tilde\mu, \\
    \operatorname{Cov}(a_k, a_l)
        &= E_h[\tilde h^\top \Sigma_{kl} \tilde h] + \operatorname{Cov}_h(\tilde M_k \tilde h,
           \tilde M_l \tilde h) \\
        &= \tilde\mu^\top \Sigma_{kl} \tilde\mu + \operatorname{tr}(\Sigma_{kl} \tilde C)
           + M_k C M_l^\top,

with :math:`M` the weight part of :math:`\tilde M` (the bias has no input variance). These are
the exact first two moments (:math:`a` itself is no longer Gaussian: a product of Gaussians);
for a diagonal :math:`C = \operatorname{diag}(c)` the trace is
:math:`\sum_j \Sigma_{kl, jj}\, c_j`. A factorised posterior (:math:`\Sigma` diagonal) recovers
:func:`~lightning_dvi.moments.linear_full`.

**The KL.** Against a factorised prior :math:`\mathcal N(0, \operatorname{diag}(s))`, the
full-Gaussian KL splits into the factorised KL of the marginals :math:`\sigma_i^2 = \Sigma_{ii}`
and a prior-free term (Hadamard's inequality makes it :math:`\ge 0`, zero iff :math:`\Sigma` is
diagonal):

.. math::
    \mathrm{KL} = \sum_i \mathrm{KL}\big(\mathcal N(m_i, \Sigma_{ii}) \,\|\,
    \mathcal N(0, s_i)\big) + \tfrac12\Big(\sum_i \log\Sigma_{ii} - \log\det\Sigma\Big),
    \qquad \log\det\Sigma = 2\textstyle\sum_i \log L_{ii}.

:func:`correlation_kl` is the second term; the empirical-Bayes optimum of :math:`s` depends
only on the marginals (the second term has no :math:`s`).

Costs: a deterministic input costs :math:`O(BK^2(D+1)^2)` (one extra contraction beyond the
mean's matrix product); a Gaussian input also forms :math:`\Sigma` (:math:`O(P^3)`, once per
pass). The parameter count is :math:`P(P+1)/2`: meant for heads (``K(D+1)`` of a few thousand).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .linear import symmetrize

__all__ = [
    "correlation_kl",
    "full_cov_linear_deterministic",
    "full_cov_linear_gaussian",
    "full_cov_linear_local",
    "full_cov_linear_sample",
    "marginal_variances",
]


def _with_one(x: Tensor) -> Tensor:
    """``[..., D] -> [..., D + 1]``: the input with a constant 1 appended (the bias column)."""
    return torch.cat([x, x.new_ones(*x.shape[:-1], 1)], dim=-1)


def _blocks(scale_tril: Tensor, out_features: int) -> Tensor:
    """``L [P, P]`` as ``[K, D + 1, P]`` (its rows grouped by output unit)."""
    return scale_tril.reshape(out_features, -1, scale_tril.shape[-1])


def marginal_variances(scale_tril: Tensor) -> Tensor:
    r""":math:`\Sigma_{ii} = \sum_r L_{ir}^2`, ``[P]`` (the diagonal of :math:`LL^\top`)."""
    return (scale_tril * scale_tril).sum(-1)


def correlation_kl(scale_tril: Tensor) -> Tensor:
    r""":math:`\tfrac12(\sum_i \log\Sigma_{ii} - \log\det\Sigma) \ge 0`, 0-dim (see the module docstring).

    The part of the full-Gaussian KL that a factorised KL with the same marginals misses. An
    exactly zero scale gives ``nan`` (infinite minus infinite), as the KL of a point mass is
    infinite anyway.
    """
    diag = scale_tril.diagonal(dim1=-2, dim2=-1)
    return 0.5 * marginal_variances(scale_tril).log().sum() - diag.log().sum()


def full_cov_linear_deterministic(
    x: Tensor, loc: Tensor, scale_tril: Tensor
) -> tuple[Tensor, Tensor]:
    r"""Mean ``[..., K]`` and covariance ``[..., K, K]`` of :math:`\tilde W [x, 1]` (exact).

    Args:
        x: deterministic input ``[..., D]``.
        loc: posterior mean :math:`\tilde M` ``[K, D + 1]`` (bias in the last column).
        scale_tril: :math:`L` ``[P, P]``, lower triangular, :math:`P = K(D+1)`.
    """
    h = _with_one(x)
    u = torch.einsum("...j,kjr->...kr", h, _blocks(scale_tril, loc.shape[0]))
    return h @ loc.transpose(-1, -2), symmetrize(u @ u.transpose(-1, -2))


def full_cov_linear_gaussian(
    mean: Tensor, cov_or_var: Tensor, loc: Tensor, scale_tril: Tensor, *, diagonal: bool
) -> tuple[Tensor, Tensor]:
    r"""Mean ``[..., K]`` and covariance ``[..., K, K]`` of the output for a Gaussian input.

    Args:
        mean: input means :math:`\mu` ``[..., D]``.
        cov_or_var: the input covariance :math:`C` ``[..., D, D]``, or (``diagonal=True``) its
            diagonal ``[..., D]``.
        loc: posterior mean :math:`\tilde M` ``[K, D + 1]``.
        scale_tril: :math:`L` ``[P, P]``.
        diagonal: whether ``cov_or_var`` holds variances only.

    Returns:
        The exact first two moments (module docstring).
    """
    out_mean, cov = full_cov_linear_deterministic(mean, loc, scale_tril)
    k, d = loc.shape[0], loc.shape[1] - 1
    sigma = scale_tril @ scale_tril.transpose(-1, -2)
    sigma_w = sigma.reshape(k, d + 1, k, d + 1)[:, :d, :, :d]  # [K, D, K, D]
    w = loc[:, :d]
    if diagonal:
        trace = cov_or_var @ sigma_w.diagonal(dim1=1, dim2=3).permute(2, 0, 1).reshape(d, k * k)
        trace = trace.reshape(*cov_or_var.shape[:-1], k, k)
        spread = (w * cov_or_var.unsqueeze(-2)) @ w.transpose(-1, -2)
    else:
        trace = torch.einsum("kjlm,...jm->...kl", sigma_w, cov_or_var)
        spread = w @ cov_or_var @ w.transpose(-1, -2)
    return out_mean, symmetrize(cov + trace + spread)


def full_cov_linear_sample(x: Tensor, loc: Tensor, scale_tril: Tensor) -> Tensor:
    r"""``x [S, ..., D]`` through one correlated weight draw :math:`\tilde W_s` per sample ``s``.

    :math:`\operatorname{vec}\tilde W_s = \operatorname{vec}\tilde M + L\varepsilon_s`,
    :math:`\varepsilon_s \sim \mathcal N(0, I)`; returns ``[S, ..., K]``.
    """
    s = x.shape[0]
    eps = torch.randn(s, scale_tril.shape[-1], dtype=x.dtype, device=x.device)
    weights = loc + (eps @ scale_tril.transpose(-1, -2)).reshape(s, *loc.shape)  # [S, K, D+1]
    h = _with_one(x).reshape(s, -1, loc.shape[1])
    return (h @ weights.transpose(-1, -2)).reshape(*x.shape[:-1], loc.shape[0])


def full_cov_linear_local(x: Tensor, loc: Tensor, scale_tril: Tensor) -> Tensor:
    r"""Local reparameterisation: an independent correlated weight draw per example and sample.

    For ``x [S, ..., D]`` each row gets :math:`a = \tilde M\tilde h + (L\varepsilon)\tilde h`
    with its own :math:`\varepsilon`, i.e. a draw of the exact output Gaussian of
    :func:`full_cov_linear_deterministic` (correlated across outputs); ``[S, ..., K]``.
    """
    h = _with_one(x)
    eps = torch.randn(*x.shape[:-1], scale_tril.shape[-1], dtype=x.dtype, device=x.device)
    noise = (eps @ scale_tril.transpose(-1, -2)).reshape(*x.shape[:-1], *loc.shape)
    return h @ loc.transpose(-1, -2) + (noise @ h.unsqueeze(-1)).squeeze(-1)
