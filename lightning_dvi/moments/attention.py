r"""Moments of multi-head scaled dot-product self-attention with Gaussian inputs and weights.

For a sequence of tokens :math:`x_1, \dots, x_T \in \mathbb R^D`, each Gaussian
(:math:`x_j \sim \mathcal N(m_j, S_j)`, **tokens independent**), and factorised Gaussian
projection weights :math:`W_q, W_k, W_v` (rows split into :math:`H` heads of width
:math:`d = D/H`), one head computes

.. math::
    q_i = W_q x_i + b_q,\quad k_j = W_k x_j + b_k,\quad
    s_{ij} = \frac{q_i^\top k_j}{\sqrt d} + \text{mask}_{ij},\quad
    A_{i\cdot} = \operatorname{softmax}(s_{i\cdot}),\quad
    o_i = \sum_j A_{ij}(W_v x_j + b_v).

**The value path is exact given the attention weights.** Because the rows of :math:`A` sum to
one, :math:`o_i = W_v z_i + b_v` with :math:`z_i = \sum_j A_{ij}x_j`: the tokens are mixed
first and projected once, so the covariance that the *shared* value weights induce between
tokens is accounted for exactly (projecting each token and then mixing them as if independent
would divide the weight-induced variance by :math:`\sum_j A_{ij}^2`). With :math:`A` independent
of :math:`x`,

.. math::
    E[z_i] = \sum_j \bar A_{ij} m_j,\qquad
    \operatorname{Cov}(z_i) = \sum_j E[A_{ij}^2]\,S_j
        + \sum_{j,k}\operatorname{Cov}(A_{ij}, A_{ik})\,m_j m_k^\top,

and :math:`W_v z_i + b_v` has the moments of a linear layer
(:func:`~lightning_dvi.moments.linear_diag` / :func:`~lightning_dvi.moments.linear_full`, called
with a block weight matrix so that every head reads its own :math:`z^h`). Across heads
:math:`\operatorname{Cov}(z^h_i, z^{h'}_i) = \sum_j \bar A^h_{ij}\bar A^{h'}_{ij} S_j` (the heads'
attention weights are taken independent).

**Rules for the attention weights** (``rule``):

* ``"mean"`` (SUQ, Dong et al. 2025): :math:`\bar A = \operatorname{softmax}(E[q]^\top E[k]
  /\sqrt d)` and :math:`A` is treated as deterministic; all variance is carried by the values.
* ``"mean_field"``: the scores' moments are carried into the softmax. With
  :math:`\bar q, v_q, \bar k, v_k` the means and marginal variances of the projections,

  .. math::
      E[s_{ij}] = \frac{\bar q_i^\top\bar k_j + \delta_{ij}\operatorname{tr}\operatorname{Cov}
          (q_i, k_i)}{\sqrt d},\qquad
      \operatorname{Cov}(s_{i\cdot}) = \operatorname{diag}(\sigma^2_{i\cdot}) + U_iU_i^\top,

  :math:`\sigma^2_{ij} = \sum_r (v_{q,ir}v_{k,jr} + \bar q_{ir}^2 v_{k,jr})/d` (independent per
  key) and :math:`U_{i,jr} = \bar k_{jr}\sqrt{v_{q,ir}/d}` (the query :math:`q_i` is shared by
  the row, so its scores are correlated; :math:`\operatorname{Cov}(q_i, k_i) = M_q S_i M_k^\top`
  through the shared token; with uncertain tokens the query variance in :math:`U_i` is the
  weights' part, and the covariance that a token's own variance makes, correlated across the
  components of its query and key, is added to first order, :func:`input_score_cov`).
  :math:`E[A_{i\cdot}]` is the pairwise mean-field probit softmax of
  the categorical predictive
  (:func:`lightning_dvi.likelihoods.functional.categorical_mean_field_predictive`), and
  :math:`\operatorname{Cov}(A_{i\cdot}) \approx J\operatorname{Cov}(s_{i\cdot})J` with the
  softmax Jacobian :math:`J = \operatorname{diag}(p) - pp^\top` at :math:`p = E[A_{i\cdot}]`
  (the delta method for the second moments). The pairwise form costs :math:`O(T^3)` per head
  and example.
* ``"delta"``: as ``"mean_field"`` with :math:`E[A_{i\cdot}]` by the second-order delta method
  (:func:`lightning_dvi.likelihoods.functional.categorical_delta_predictive`).
* ``"unscented"`` (the default of :class:`lightning_dvi.nn.MultiheadAttention`): the same score
  moments; :math:`E[A_{i\cdot}]` **and** :math:`\operatorname{Cov}(A_{i\cdot})` by three-point
  Gauss-Hermite quadrature along each principal axis of :math:`\operatorname{Cov}(s_{i\cdot})`
  (:func:`unscented_softmax`: exact to degree 3 and for the pure fourth and fifth powers along
  each axis, where the delta method stops at degree 2 for the mean and 1 for the covariance).
  :math:`\operatorname{Cov}(A_{i\cdot}) = F_iF_i^\top` with :math:`2T_k` factor columns
  (against :math:`T_k + d + D + 1` for :math:`J[\operatorname{diag}(\sigma), U]`), so it is
  cheaper than ``"mean_field"`` past a few tokens, despite an eigendecomposition per row.

At zero variance every rule are exactly softmax attention. Masked keys (``causal``,
``key_padding_mask``) get attention weight exactly zero and no variance. Measured against Monte
Carlo over weights and inputs in ``docs/transformers.md``.

**What is kept.** Outputs are per token: ``[B, T, D]`` means with per-token variances
(``diag``) or per-token feature covariances ``[B, T, D, D]`` (``full``); the covariance between
tokens is not formed (a full ``[TD, TD]`` covariance per example is out of reach), so
downstream of an attention layer tokens are treated as independent.
"""

from __future__ import annotations

import math
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from .linear import linear_deterministic, linear_diag, linear_full
from .special import flush

__all__ = [
    "ATTENTION_RULES",
    "AttentionRule",
    "AttentionWeights",
    "ProjectionMoments",
    "attention_mask",
    "attention_weights",
    "input_score_cov",
    "mix_tokens_diag",
    "mix_tokens_full",
    "principal_factor",
    "self_attention_moments",
    "self_attention_weights",
    "unscented_softmax",
    "value_weights",
]

AttentionRule = Literal["mean", "delta", "mean_field", "unscented"]
ATTENTION_RULES: tuple[str, ...] = ("mean", "delta", "mean_field", "unscented")

# A masked score is placed this far below its row's smallest real score (before the probit
# scaling): exp(-60) is 1e-26 relative, and nothing overflows (unlike -inf, whose differences
# are NaN).
_MASK_GAP = 60.0


class ProjectionMoments(NamedTuple):
    """A projection's weight moments ``(w_loc [out, in], w_var, b_loc [out], b_var)``.

    ``w_var``/``b_var`` are ``None`` for deterministic weights (and ``b_loc`` for no bias).
    """

    w_loc: Tensor
    w_var: Tensor | None
    b_loc: Tensor | None
    b_var: Tensor | None


class AttentionWeights(NamedTuple):
    r"""Moments of the attention weights of every head, ``[B, H, T_q, T_k]``.

    Attributes:
        mean: :math:`E[A]`.
        var: :math:`\operatorname{Var}(A_{ij})` (``None``: the weights are treated as
            deterministic, rule ``"mean"``).
        score_var: :math:`\sigma^2_{ij}`, the per-key part of the score covariance.
        shared: :math:`U_{i,jr}` ``[B, H, T_q, T_k, d]``, its low-rank part
            :math:`\operatorname{Cov}(s_{i\cdot}) = \operatorname{diag}(\sigma^2_{i\cdot}) + U_iU_i^\top`.
        factors: :math:`F_i` ``[B, H, T_q, T_k, K]`` with
            :math:`\operatorname{Cov}(A_{i\cdot}) \approx F_iF_i^\top` (rule ``"unscented"``);
            ``None``: the delta method's :math:`J_i[\operatorname{diag}(\sigma_{i\cdot}), U_i]`.
    """

    mean: Tensor
    var: Tensor | None
    score_var: Tensor | None
    shared: Tensor | None
    factors: Tensor | None = None


def attention_mask(
    t_q: int,
    t_k: int,
    causal: bool,
    key_padding_mask: Tensor | None,
    device: torch.device,
) -> Tensor | None:
    """Which keys each query may attend to, ``[B or 1, 1, T_q, T_k]`` (bool), or ``None``.

    Args:
        t_q: number of queries.
        t_k: number of keys.
        causal: query ``i`` sees keys ``j <= i`` only.
        key_padding_mask: ``[B, T_k]``, ``True`` where a key is padding (ignored), as in torch.
        device: the device of the mask.
    """
    allowed: Tensor | None = None
    if causal:
        allowed = torch.ones(t_q, t_k, dtype=torch.bool, device=device).tril()[None, None]
    if key_padding_mask is not None:
        if key_padding_mask.dtype != torch.bool:
            raise ValueError(
                f"key_padding_mask must be bool (True = padding), got {key_padding_mask.dtype}"
            )
        keys = ~key_padding_mask.to(device)[:, None, None, :]
        allowed = keys if allowed is None else allowed & keys
    return allowed


def _sqrt(x: Tensor) -> Tensor:
    """``sqrt(x)`` with a zero (not infinite, not NaN) gradient at ``x = 0``."""
    tiny = torch.finfo(x.dtype).tiny
    return torch.where(x > tiny, x.clamp_min(tiny).sqrt(), torch.zeros_like(x))


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``[..., T, H * d] -> [..., H, T, d]``."""
    *batch, t, width = x.shape
    return x.reshape(*batch, t, heads, width // heads).transpose(-2, -3)


def merge_heads(x: Tensor) -> Tensor:
    """``[..., H, T, d] -> [..., T, H * d]``."""
    return x.transpose(-2, -3).flatten(-2)


def _masked(scores: Tensor, allowed: Tensor | None, fill: Tensor | float) -> Tensor:
    if allowed is None:
        return scores
    return torch.where(allowed, scores, fill)


def attention_weights(
    q_mean: Tensor,
    q_var: Tensor,
    k_mean: Tensor,
    k_var: Tensor,
    *,
    rule: AttentionRule,
    allowed: Tensor | None = None,
    same_token: Tensor | None = None,
    key_shared: Tensor | None = None,
    input_cov: Tensor | None = None,
) -> AttentionWeights:
    r"""Moments of the attention weights :math:`A = \operatorname{softmax}(qk^\top/\sqrt d)`.

    Args:
        q_mean: query means ``[B, H, T_q, d]``.
        q_var: query marginal variances, same shape.
        k_mean: key means ``[B, H, T_k, d]``.
        k_var: the key variances that are independent from key to key (from the tokens' own
            variance), same shape.
        rule: ``"mean"`` (softmax of the mean scores; :math:`A` deterministic) or
            ``"mean_field"``, ``"delta"`` or ``"unscented"`` (module docstring).
        allowed: ``[B or 1, 1, T_q, T_k]`` bool (:func:`attention_mask`) or ``None``.
        same_token: :math:`\operatorname{tr}\operatorname{Cov}(q_i, k_i)` per head
            ``[B, H, T]`` (self-attention: query and key of a token share its input), added to
            the diagonal mean scores by the rules other than ``"mean"``; ``None``: zero.
        key_shared: further columns of :math:`U_i` ``[B, H, T_q, T_k, R]``: the score
            covariance that the key weights shared by all keys induce (see
            :func:`self_attention_moments`); ``None``: none.
        input_cov: a further score covariance ``[B, H, T_q, T_k, T_k]`` used for
            :math:`E[A]` only (the tokens' own variance, :func:`input_score_cov`); ``None``:
            none.

    Returns:
        :class:`AttentionWeights`.
    """
    if rule not in ATTENTION_RULES:
        raise ValueError(f"rule must be one of {ATTENTION_RULES}, got {rule!r}")
    d = q_mean.shape[-1]
    scale = 1.0 / math.sqrt(d)
    mean_scores = (q_mean @ k_mean.transpose(-1, -2)) * scale
    if rule == "mean":
        scores = _masked(mean_scores, allowed, float("-inf"))
        return AttentionWeights(torch.softmax(scores, -1), None, None, None)
    from ..likelihoods.functional import (
        categorical_delta_predictive,
        categorical_mean_field_predictive,
    )

    if same_token is not None and mean_scores.shape[-1] == mean_scores.shape[-2]:
        mean_scores = mean_scores + torch.diag_embed(same_token * scale)
    score_var = (q_var + q_mean * q_mean) @ k_var.transpose(-1, -2) * (scale * scale)
    # U_{i,jr} = kbar_jr sqrt(v_q,ir / d): [B, H, Tq, Tk, d]
    shared = k_mean.unsqueeze(-3) * _sqrt(q_var * (scale * scale)).unsqueeze(-2)
    if key_shared is not None:
        shared = torch.cat([shared, key_shared], -1)
    if allowed is not None:
        low = mean_scores.detach().masked_fill(~allowed, float("inf")).amin(-1, keepdim=True)
        low = torch.where(torch.isfinite(low), low, torch.zeros_like(low))
        mean_scores = _masked(mean_scores, allowed, low - _MASK_GAP)
        score_var = _masked(score_var, allowed, 0.0)
        shared = shared * allowed.unsqueeze(-1)
    cov = torch.diag_embed(score_var) + shared @ shared.transpose(-1, -2)
    if input_cov is not None:
        if allowed is not None:
            input_cov = input_cov * (allowed.unsqueeze(-1) & allowed.unsqueeze(-2))
        cov = cov + input_cov
    if rule == "unscented":
        keys = None if allowed is None else allowed.expand_as(mean_scores)
        p, factors = unscented_softmax(mean_scores, cov, keys)
        if allowed is not None:
            p = p * allowed
            factors = factors * allowed.unsqueeze(-1)
        p = flush(p)
        var = flush((factors * factors).sum(-1))
        return AttentionWeights(p, var, score_var, shared, factors)
    if rule == "delta":
        p = categorical_delta_predictive(mean_scores, cov)
    else:
        p = categorical_mean_field_predictive(mean_scores, cov)
    if allowed is not None:
        p = p * allowed
        p = p / p.sum(-1, keepdim=True).clamp_min(torch.finfo(p.dtype).tiny)
    p = flush(p)
    return AttentionWeights(p, fluctuation_var(p, score_var, shared), score_var, shared)


_ROOT3 = math.sqrt(3.0)


def principal_factor(cov: Tensor) -> Tensor:
    r"""A square root :math:`L` of :math:`C` ``[..., K, K]`` whose columns are its principal axes.

    :math:`L = Q\,(\operatorname{diag}(s) + O/(s_k + s_l))` with :math:`Q` the eigenvectors of
    :math:`C` (**detached**: no gradient flows through the eigendecomposition, whose derivative
    is unbounded at repeated eigenvalues), :math:`B = Q^\top CQ`, :math:`s = \sqrt{B_{kk}}` and
    :math:`O` the off-diagonal part of :math:`B` (zero up to rounding). The value is
    :math:`Q\operatorname{diag}(\sqrt\lambda)`; the derivative of :math:`LL^\top` is exactly
    :math:`dC` (the first-order symmetric square root of :math:`B` about its diagonal), so
    everything of second order in :math:`C` has its exact gradient, and only the axes'
    dependence on :math:`C` is dropped.
    """
    with torch.no_grad():
        q: Tensor = torch.linalg.eigh(cov)[1]
    b = q.transpose(-1, -2) @ cov @ q
    s = _sqrt(b.diagonal(0, -2, -1).clamp_min(0))
    off = b - torch.diag_embed(b.diagonal(0, -2, -1))
    pair = s.unsqueeze(-1) + s.unsqueeze(-2)
    tol = torch.finfo(cov.dtype).eps ** 0.5 * pair.amax((-1, -2), keepdim=True)
    ok = pair > tol.clamp_min(torch.finfo(cov.dtype).tiny)
    root = torch.diag_embed(s) + torch.where(ok, off / torch.where(ok, pair, 1.0), 0.0)
    return q @ root


def unscented_softmax(
    mean: Tensor, cov: Tensor, allowed: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""Mean and covariance factors of :math:`\operatorname{softmax}(s)`, :math:`s \sim \mathcal N(\mu, C)`.

    Three-point Gauss-Hermite along each principal axis :math:`l_k` of :math:`C`
    (:func:`principal_factor`), anchored at the mean: with :math:`f = \operatorname{softmax}`,
    :math:`f_0 = f(\mu)` and :math:`f_k^\pm = f(\mu \pm \sqrt3\,l_k)`,

    .. math::
        E[f(s)] \approx f_0 + \sum_k \tfrac16\,(f_k^+ + f_k^- - 2f_0),\qquad
        \operatorname{Cov}(f(s)) \approx \sum_k \big(u_ku_k^\top/12 + c_kc_k^\top/18\big),

    :math:`u_k = f_k^+ - f_k^-`, :math:`c_k = f_k^+ + f_k^- - 2f_0` (the three-point rule's
    variance along :math:`l_k`). This is the unscented transform with :math:`\kappa = 3 - K`
    on the principal axes: exact for every polynomial of degree 3 and for the pure
    fourth and fifth powers along each axis, where the delta method
    (:func:`~lightning_dvi.likelihoods.functional.categorical_delta_predictive`, and
    :math:`JCJ` for the covariance) stops at degree 2 and 1; only products of
    powers of two axes of total degree 4 and up are missed (that is why the axes are the
    principal ones, not any factor of :math:`C`). Cost: an eigendecomposition and
    :math:`2K` softmaxes of length :math:`K` per row.

    The softmax ignores a shift of every score by the same amount, so :math:`C` is first
    centred, :math:`PCP^\top` with :math:`P = I - \mathbb 1_a a^\top` (:math:`a` the allowed
    keys' indicator over their number): the result is then exactly invariant to such a shift
    (a key bias's noise), which would otherwise tilt the axes.

    Args:
        mean: score means ``[..., K]``.
        cov: score covariances ``[..., K, K]``.
        allowed: ``[..., K]`` bool, the keys that are not masked (their scores have no
            variance and lie far below the others); ``None``: every key.

    Returns:
        ``(mean [..., K], factors [..., K, 2K])``: the probabilities (non-negative, summing to
        one) and :math:`F` with :math:`\operatorname{Cov} \approx FF^\top`.
    """
    keys = torch.ones_like(mean) if allowed is None else allowed.to(mean.dtype)
    avg = keys / keys.sum(-1, keepdim=True).clamp_min(1)
    row = cov @ avg.unsqueeze(-1)  # C a: [..., K, 1]
    both = avg.unsqueeze(-2) @ row  # a^T C a
    lift = keys.unsqueeze(-1)
    cov = cov - lift @ row.mT - row @ lift.mT + lift @ both @ lift.mT
    axes = principal_factor(cov).transpose(-1, -2)  # [..., K axes, K keys]
    centre = torch.softmax(mean, -1)
    shifted = mean.unsqueeze(-2)
    plus = torch.softmax(shifted + _ROOT3 * axes, -1)
    minus = torch.softmax(shifted - _ROOT3 * axes, -1)
    curve = plus + minus - 2 * centre.unsqueeze(-2)
    p = (centre + curve.sum(-2) / 6).clamp_min(0)
    p = p / p.sum(-1, keepdim=True)
    factors = torch.cat([(plus - minus) / math.sqrt(12.0), curve / math.sqrt(18.0)], -2)
    return p, factors.transpose(-1, -2)


def fluctuation_var(p: Tensor, score_var: Tensor, shared: Tensor) -> Tensor:
    r""":math:`\operatorname{Var}(A_{ij}) \approx [J\operatorname{diag}(\sigma^2)J + (JU)(JU)^\top]_{jj}`, :math:`J = \operatorname{diag}(p) - pp^\top`."""
    p2s = (p * p * score_var).sum(-1, keepdim=True)
    var = p * p * ((1 - 2 * p) * score_var + p2s)
    ju = p.unsqueeze(-1) * (shared - (p.unsqueeze(-1) * shared).sum(-2, keepdim=True))
    return flush((var + (ju * ju).sum(-1)).clamp_min(0))


def _jacobian_times(p: Tensor, values: Tensor) -> Tensor:
    r""":math:`G = JM` per row: ``p [B,H,Tq,Tk]``, ``values [B,1,Tk,D]`` -> ``[B,H,Tq,Tk,D]``."""
    mixed = p @ values  # [B, H, Tq, D]
    return p.unsqueeze(-1) * (values.unsqueeze(-3) - mixed.unsqueeze(-2))


def weight_fluctuation_factors(weights: AttentionWeights, mean: Tensor) -> Tensor | None:
    r"""Factors :math:`F_i` with :math:`\sum_{jk}\operatorname{Cov}(A_{ij}, A_{ik})m_jm_k^\top = F_iF_i^\top`.

    With :math:`G = JM` (:math:`J` the softmax Jacobian of row :math:`i`, :math:`M` the token
    means) and :math:`\operatorname{Cov}(A_{i\cdot}) = J(\operatorname{diag}(\sigma^2) + UU^\top)J`:
    :math:`F_i = [G^\top\operatorname{diag}(\sigma); G^\top U]`, ``[B, H, T_q, D, T_k + R]``;
    ``None`` when the weights are deterministic.
    """
    if weights.factors is not None:
        return torch.einsum("bhijk,bjc->bhick", weights.factors, mean)
    if weights.var is None or weights.score_var is None or weights.shared is None:
        return None
    g = _jacobian_times(weights.mean, mean.unsqueeze(1))  # [B, H, Tq, Tk, D]
    own = g * _sqrt(weights.score_var).unsqueeze(-1)
    return torch.cat([own, weights.shared.transpose(-1, -2) @ g], -2).transpose(-1, -2)


def mix_tokens_diag(weights: AttentionWeights, mean: Tensor, var: Tensor) -> tuple[Tensor, Tensor]:
    r"""Per-head means and the independent part of the variances of :math:`z_i = \sum_j A_{ij}x_j`.

    Args:
        weights: the attention weights' moments (:func:`attention_weights`).
        mean: token means ``[B, T_k, D]``.
        var: token variances ``[B, T_k, D]`` (tokens and units independent).

    Returns:
        ``(mean, var)``, each ``[B, H, T_q, D]``, with
        :math:`\operatorname{var}_c = \sum_j E[A_{ij}^2]v_{jc}`; the rest of
        :math:`\operatorname{Cov}(z_i)` is :math:`F_iF_i^\top` (:func:`weight_fluctuation_factors`).
    """
    a = weights.mean
    second = a * a if weights.var is None else a * a + weights.var
    return a @ mean.unsqueeze(1), flush(second @ var.unsqueeze(1))


def mix_tokens_full(
    weights: AttentionWeights, mean: Tensor, cov: Tensor, jacobian: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""Means ``[B, T_q, H*D]`` and covariances ``[B, T_q, H*D, H*D]`` of the stacked :math:`z^h_i`.

    Block :math:`(h, h')` of token :math:`i`:
    :math:`\sum_j(\bar A^h_{ij}\bar A^{h'}_{ij} + \delta_{hh'}\operatorname{Var}A^h_{ij})S_j
    + \delta_{hh'}F^h_iF^{h\top}_i` (:func:`weight_fluctuation_factors`).

    Args:
        weights: the attention weights' moments.
        mean: token means ``[B, T_k, D]``.
        cov: per-token covariances ``[B, T_k, D, D]`` (tokens independent).
        jacobian: :func:`input_jacobian_full`, which replaces the
            :math:`\bar A^h\bar A^{h'}S_j` term (it holds it, and the tokens' variance carried
            through the attention weights); ``None``: that term.
    """
    a = weights.mean  # [B, H, Tq, Tk]
    b, h, tq, _ = a.shape
    d_in = mean.shape[-1]
    out_mean = (a @ mean.unsqueeze(1)).transpose(1, 2).flatten(-2)  # [B, Tq, H*D]
    eye = torch.eye(h, dtype=a.dtype, device=a.device)
    pair = a.new_zeros(()) if jacobian is not None else torch.einsum("bhij,bgij->bihgj", a, a)
    if weights.var is not None:
        pair = pair + torch.einsum("bhij,hg->bihgj", weights.var, eye)
    blocks = torch.einsum("bihgj,bjcd->bihcgd", pair, cov)  # [B, Tq, H, D, H, D]
    if jacobian is not None:
        blocks = blocks + jacobian
    factors = weight_fluctuation_factors(weights, mean)
    if factors is not None:
        own = (factors @ factors.transpose(-1, -2)).transpose(1, 2)  # [B, Tq, H, D, D]
        eye = torch.eye(h, dtype=a.dtype, device=a.device)
        blocks = blocks + torch.einsum("bihce,hg->bihcge", own, eye)
    out_cov = blocks.reshape(b, tq, h * d_in, h * d_in)
    out_cov = 0.5 * (out_cov + out_cov.transpose(-1, -2))
    return out_mean, out_cov


def value_weights(value: ProjectionMoments, heads: int) -> ProjectionMoments:
    r"""The value projection as one block weight matrix ``[D, H * D_in]`` over stacked :math:`z^h`.

    Row block :math:`h` of :math:`W_v` reads column block :math:`h` (that head's mixed input),
    so :math:`o = \operatorname{blockdiag}(W_v^h)\,[z^1; \dots; z^H] + b_v`: one linear-layer
    moment call for every head.
    """
    w_loc, w_var, b_loc, b_var = value
    out, d_in = w_loc.shape

    def block(w: Tensor) -> Tensor:
        blocks: Tensor = torch.block_diag(*w.reshape(heads, out // heads, d_in).unbind(0))
        return blocks

    return ProjectionMoments(block(w_loc), None if w_var is None else block(w_var), b_loc, b_var)


def _zeros_like(w: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if w is None else w


def _project(
    mean: Tensor, second: Tensor | None, proj: ProjectionMoments, full: bool
) -> tuple[Tensor, Tensor]:
    """A linear layer's moments for a deterministic (``second is None``), diag or full input."""
    w_loc, w_var, b_loc, b_var = proj
    w_var = _zeros_like(w_var, w_loc)
    if b_loc is not None:
        b_var = _zeros_like(b_var, b_loc)
    if second is None:
        return linear_deterministic(mean, w_loc, w_var, b_loc, b_var)
    if full:
        return linear_full(mean, second, w_loc, w_var, b_loc, b_var)
    return linear_diag(mean, second, w_loc, w_var, b_loc, b_var)


def _same_token_trace(
    q: ProjectionMoments, k: ProjectionMoments, second: Tensor | None, heads: int, full: bool
) -> Tensor | None:
    r""":math:`\operatorname{tr}\operatorname{Cov}(q^h_i, k^h_i) = \sum_{r\in h}(M_qS_iM_k^\top)_{rr}`, ``[B, H, T]``."""
    if second is None:
        return None
    if full:
        per_row = torch.einsum("rc,btcd,rd->btr", q.w_loc, second, k.w_loc)
    else:
        per_row = second @ (q.w_loc * k.w_loc).transpose(-1, -2)
    out: Tensor = per_row.unflatten(-1, (heads, -1)).sum(-1).transpose(-1, -2)
    return out


def _key_input_var(key: ProjectionMoments, second: Tensor, full: bool) -> Tensor:
    r"""The key variance from the token's own variance, :math:`\operatorname{diag}(M_kS_jM_k^\top) + s_jV_k^\top`.

    Independent from key to key (tokens are independent); the rest of the key variance comes
    from the weights shared by every key (the ``key_shared`` factors).
    """
    var = second.diagonal(0, -2, -1) if full else second
    if full:
        out = torch.einsum("rc,btcd,rd->btr", key.w_loc, second, key.w_loc)
    else:
        out = var @ (key.w_loc * key.w_loc).transpose(-1, -2)
    return out if key.w_var is None else out + var @ key.w_var.transpose(-1, -2)


def _key_shared(
    key: ProjectionMoments, q_mean: Tensor, q_var: Tensor, mean: Tensor, heads: int
) -> Tensor | None:
    r"""Columns :math:`m_{jc}\sqrt{a_{ic}/d}` (and :math:`\sqrt{b_i/d}`) of :math:`U_i`, ``[B, H, T_q, T_k, D + 1]``.

    The key weights are shared by every key: :math:`\operatorname{Cov}(k_{jr}, k_{kr}) \ni
    \sum_c V_{k,rc}m_{jc}m_{kc} + u_{k,r}`, so the scores of row :math:`i` covary by
    :math:`\frac1d(\sum_c a_{ic}m_{jc}m_{kc} + b_i)` with :math:`a_{ic} = \sum_{r\in h}(\bar
    q_{ir}^2 + v_{q,ir})V_{k,rc}` and :math:`b_i = \sum_{r\in h}(\bar q_{ir}^2 + v_{q,ir})u_{k,r}`.
    (The last, the key bias noise, shifts a whole row of scores: the softmax rules cancel it
    exactly.)
    """
    if key.w_var is None:
        return None
    d = q_mean.shape[-1]
    second = q_mean * q_mean + q_var
    v_heads = key.w_var.reshape(heads, d, -1)  # [H, d, D]
    a = torch.einsum("bhir,hrc->bhic", second, v_heads)
    columns = mean[:, None, None, :, :] * _sqrt(a / d).unsqueeze(-2)
    if key.b_var is None:
        return columns
    b = (second * key.b_var.reshape(heads, 1, d)).sum(-1, keepdim=True)  # [B, H, Tq, 1]
    shift = _sqrt(b / d).unsqueeze(-2).expand(*columns.shape[:-1], 1)
    return torch.cat([columns, shift], -1)


def input_score_cov(
    qh: Tensor,
    kh: Tensor,
    query: ProjectionMoments,
    key: ProjectionMoments,
    second: Tensor,
    full: bool,
    key_var: Tensor,
) -> Tensor:
    r"""The score covariance that the tokens' own variance adds, ``[B, H, T_q, T_k, T_k]``.

    To first order in the tokens, :math:`s_{il}` moves with :math:`x_l` along
    :math:`g_i = M_k^\top\bar q_i/\sqrt d` (its key) and with :math:`x_i` along
    :math:`\tilde k_l = M_q^\top\bar k_l/\sqrt d` (the query, shared by the row), both
    along :math:`\tilde k_i + g_i` for :math:`l = i`:

    .. math::
        \operatorname{Cov}(s_{il}, s_{im}) \ni (\tilde k_l + \delta_{il}g_i)^\top S_i
            (\tilde k_m + \delta_{im}g_i) + \delta_{lm}(1 - \delta_{il})\,g_i^\top S_lg_i
            + \delta_{lm}\,\tfrac1d\big(v^{x}_{q,i}{}^\top k^{v}_l
            - \bar q_i^{\circ2\top}\operatorname{diag}(M_kS_lM_k^\top)\big),

    the last term exchanging what :func:`attention_weights` computes from marginal
    variances alone (``q_var`` the query weights' part :math:`v^w_q`, ``k_var`` the whole
    :math:`k^v`: :math:`(\bar q^{\circ2} + v^w_q)^\top k^v/d`) for the product of the
    query's input part :math:`v^x_q = \operatorname{diag}(M_qS_iM_q^\top)` and the key's.
    These are the correlations between the components of a query or key that one token's
    variance makes (the marginal variances alone miss a factor up to :math:`d`).

    Args:
        qh: query means per head ``[B, H, T, d]``.
        kh: key means per head.
        query: the query projection's moments.
        key: the key projection's.
        second: token variances ``[B, T, D]`` or covariances ``[B, T, D, D]``.
        full: ``second`` is covariances.
        key_var: :func:`_key_input_var` ``[B, T, D_k]``.
    """
    heads, d = qh.shape[1], qh.shape[-1]
    root = math.sqrt(d)
    m_k = key.w_loc.reshape(heads, d, -1)
    m_q = query.w_loc.reshape(heads, d, -1)
    g = torch.einsum("bhir,hrc->bhic", qh, m_k) / root  # [B, H, T, D]
    k_tilde = torch.einsum("bhlr,hrc->bhlc", kh, m_q) / root
    t = qh.shape[-2]
    eye = torch.eye(t, dtype=qh.dtype, device=qh.device)
    along = k_tilde.unsqueeze(2) + eye[:, :, None] * g.unsqueeze(3)  # [B, H, Tq, Tk, D]
    if full:
        q_in = torch.einsum("rc,btcd,rd->btr", query.w_loc, second, query.w_loc)
        k_in = torch.einsum("rc,btcd,rd->btr", key.w_loc, second, key.w_loc)
        shared = torch.einsum("bhilc,bicd->bhild", along, second) @ along.transpose(-1, -2)
        own = torch.einsum("bhic,bjcd,bhid->bhij", g, second, g)
    else:
        q_in = second @ (query.w_loc * query.w_loc).transpose(-1, -2)
        k_in = second @ (key.w_loc * key.w_loc).transpose(-1, -2)
        shared = (along * second[:, None, :, None, :]) @ along.transpose(-1, -2)
        own = (g * g) @ second.unsqueeze(1).transpose(-1, -2)
    q_in, k_in, k_all = (split_heads(v, heads) for v in (q_in, k_in, key_var))
    product = (q_in @ k_all.transpose(-1, -2) - (qh * qh) @ k_in.transpose(-1, -2)) / d
    return shared + torch.diag_embed(product + own * (1 - eye))


def _input_coupling(
    weights: AttentionWeights,
    qh: Tensor,
    kh: Tensor,
    query: ProjectionMoments,
    key: ProjectionMoments,
    second: Tensor,
    full: bool,
) -> Tensor:
    r"""First-order :math:`\sum_j\operatorname{Cov}(A_{ij}, x_j)`, ``[B, H, T, D]`` (Stein's lemma).

    The attention weights depend on the tokens they mix: :math:`E[z_i] = \sum_j\bar A_{ij}m_j
    + \sum_j\operatorname{Cov}(A_{ij}, x_j)` with, to first order,
    :math:`\operatorname{Cov}(A_{ij}, x_j) = S_j\,\nabla_{x_j}A_{ij}`:
    :math:`\nabla_{x_j}A_{ij} = p_{ij}(1 - p_{ij})M_k^\top\bar q_i/\sqrt d` through the key,
    plus for :math:`j = i` the query's :math:`p_{ii}M_q^\top(\bar k_i - \sum_k p_{ik}\bar k_k)/\sqrt d`.
    """
    p = weights.mean
    heads, d = qh.shape[1], qh.shape[-1]
    root = math.sqrt(d)
    m_k = key.w_loc.reshape(heads, d, -1)
    m_q = query.w_loc.reshape(heads, d, -1)
    g = torch.einsum("bhir,hrc->bhic", qh, m_k) / root
    c = p * (1 - p)
    own = p.diagonal(0, -2, -1).unsqueeze(-1) * (kh - p @ kh)  # [B, H, T, d]
    g2 = torch.einsum("bhir,hrc->bhic", own, m_q) / root
    if full:
        shift = torch.einsum("bhij,bjcd,bhid->bhic", c, second, g)
        return shift + torch.einsum("bicd,bhid->bhic", second, g2)
    return g * (c @ second.unsqueeze(1)) + second.unsqueeze(1) * g2


def _weights_and_heads(
    mean: Tensor,
    second: Tensor | None,
    query: ProjectionMoments,
    key: ProjectionMoments,
    heads: int,
    rule: AttentionRule,
    causal: bool,
    key_padding_mask: Tensor | None,
) -> tuple[AttentionWeights, Tensor, Tensor]:
    full = second is not None and second.dim() == mean.dim() + 1
    if query.w_loc.shape[0] % heads:
        raise ValueError(f"the query width must be a multiple of heads={heads}")
    allowed = attention_mask(mean.shape[-2], mean.shape[-2], causal, key_padding_mask, mean.device)
    if rule == "mean":  # the weights from the query and key means alone: no variance projected
        qh = split_heads(torch.nn.functional.linear(mean, query.w_loc, query.b_loc), heads)
        kh = split_heads(torch.nn.functional.linear(mean, key.w_loc, key.b_loc), heads)
        unused = torch.zeros_like(qh)  # the rule reads no variance
        return attention_weights(qh, unused, kh, unused, rule=rule, allowed=allowed), qh, kh
    var = None if second is None else (second.diagonal(0, -2, -1) if full else second)
    q_mean, q_var = _project(mean, var, query, False)
    k_mean, _ = _project(mean, var, key, False)
    qh, qv, kh = split_heads(q_mean, heads), split_heads(q_var, heads), split_heads(k_mean, heads)
    k_ind = torch.zeros_like(k_mean) if second is None else _key_input_var(key, second, full)
    same = None if second is None else _same_token_trace(query, key, second, heads, full)
    key_shared = _key_shared(key, qh, qv, mean, heads)
    if var is None:
        weights = attention_weights(
            qh,
            qv,
            kh,
            split_heads(k_ind, heads),
            rule=rule,
            allowed=allowed,
            key_shared=key_shared,
        )
        return weights, qh, kh
    assert second is not None
    d = qh.shape[-1]
    q_weight_var = _project(mean, None, query, False)[1]  # (m^2) V^T + u: no input variance
    if query.w_var is not None:
        q_weight_var = q_weight_var + var @ query.w_var.transpose(-1, -2)
    vqw = split_heads(q_weight_var, heads)
    weights = attention_weights(
        qh, vqw, kh, split_heads(k_ind, heads),
        rule=rule, allowed=allowed, same_token=same, key_shared=key_shared,
        input_cov=input_score_cov(qh, kh, query, key, second, full, k_ind),
    )  # fmt: skip
    # The tokens' own variance moves the weights too; that part is carried exactly to first
    # order by the Jacobian of z (input_jacobian_*), so the fluctuation kept here is the
    # weights' alone: the query weights' and the key weights' (shared by every key).
    if rule == "unscented":  # the weights' fluctuation alone, by the same rule
        alone = attention_weights(
            qh, vqw, kh, torch.zeros_like(kh),
            rule=rule, allowed=allowed, same_token=same, key_shared=key_shared,
        )  # fmt: skip
        zero = torch.zeros_like(weights.mean)
        assert alone.var is not None and alone.shared is not None
        return AttentionWeights(weights.mean, alone.var, zero, alone.shared, alone.factors), qh, kh
    parts = [kh.unsqueeze(-3) * _sqrt(vqw / d).unsqueeze(-2)]
    if key_shared is not None:
        parts.append(key_shared)
    shared = torch.cat(parts, -1)
    if allowed is not None:
        shared = shared * allowed.unsqueeze(-1)
    zero = torch.zeros_like(weights.mean)
    p = weights.mean
    return AttentionWeights(p, fluctuation_var(p, zero, shared), zero, shared), qh, kh


def _jacobian_parts(
    weights: AttentionWeights,
    qh: Tensor,
    kh: Tensor,
    query: ProjectionMoments,
    key: ProjectionMoments,
    mean: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    r"""``(G [B,H,Tq,Tk,D], g [B,H,Tq,D], R [B,H,Tq,D,D])`` of :math:`\partial z_i/\partial x_j`.

    :math:`\partial z_i/\partial x_j = p_{ij}I + G_{ij}g_i^\top + \delta_{ij}R_i` with
    :math:`G_{ij} = p_{ij}(m_j - \bar z_i)`, :math:`g_i = M_k^\top\bar q_i/\sqrt d` (through the
    key of :math:`x_j`) and :math:`R_i = \sum_l G_{il}(M_q^\top\bar k_l)^\top/\sqrt d` (through
    the query of :math:`x_i`).
    """
    heads, d = qh.shape[1], qh.shape[-1]
    root = math.sqrt(d)
    g_big = _jacobian_times(weights.mean, mean.unsqueeze(1))
    g = torch.einsum("bhir,hrc->bhic", qh, key.w_loc.reshape(heads, d, -1)) / root
    k_tilde = torch.einsum("bhlr,hrc->bhlc", kh, query.w_loc.reshape(heads, d, -1)) / root
    r = torch.einsum("bhilc,bhle->bhice", g_big, k_tilde)
    return g_big, g, r


def input_jacobian_diag(
    weights: AttentionWeights, parts: tuple[Tensor, Tensor, Tensor], var: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    r"""The tokens' variance through :math:`\partial z_i/\partial x_j`, as a diagonal and factors.

    For :math:`j \ne i`, with :math:`S_j = \operatorname{diag}(v_j)`, :math:`u = S_jg_i` and
    :math:`c = g_i^\top S_jg_i`:

    .. math::
        (pI + Gg^\top)S_j(pI + gG^\top) = p^2S_j + ff^\top - hh^\top,\qquad
        f = \sqrt c\,G + h,\quad h = (p/\sqrt c)\,u,

    a diagonal part and one added and one subtracted factor per key, which the caller carries
    through the mean value and output weights (exactly, as the weights' fluctuation). The
    :math:`p^2v_j` diagonal is in :func:`mix_tokens_diag`; the query path :math:`R_i` of
    :math:`j = i` contributes its diagonal.

    Returns:
        ``(diagonal correction [B, H, T_q, D], factors, subtracted factors)``, the factors
        ``[B, H, T_q, D, T_k]``.
    """
    g_big, g, r = parts
    p = weights.mean
    v = var.unsqueeze(1)  # [B, 1, Tk, D]
    u = v.unsqueeze(-3) * g.unsqueeze(-2)  # [B, H, Tq, Tk, D]
    c = (g * g) @ v.transpose(-1, -2)  # [B, H, Tq, Tk]
    tiny = torch.finfo(c.dtype).tiny
    ok = c > tiny
    inv_root = torch.where(ok, c.clamp_min(tiny).rsqrt(), torch.zeros_like(c))
    minus = (p * inv_root).unsqueeze(-1) * u
    factors = _sqrt(c).unsqueeze(-1) * g_big + minus
    diag = torch.zeros_like(g)
    # j = i: the query path R_i, (pI + Gg^T + R)S(.)^T - (pI + Gg^T)S(.)^T, its diagonal
    p_ii = p.diagonal(0, -2, -1).unsqueeze(-1)  # [B, H, T, 1]
    g_ii = g_big.diagonal(0, -3, -2).transpose(-1, -2)  # [B, H, T, D]
    r_diag = r.diagonal(0, -2, -1)
    diag = diag + 2 * p_ii * r_diag * v
    diag = diag + 2 * g_ii * (r * (g * v).unsqueeze(-2)).sum(-1)
    diag = diag + (r * r * v.unsqueeze(-2)).sum(-1)
    return diag, factors.transpose(-1, -2), minus.transpose(-1, -2)


def _input_through_heads(
    p: Tensor, parts: tuple[Tensor, Tensor, Tensor], var: Tensor, c_heads: Tensor
) -> Tensor:
    r"""The output variance from :math:`Gg^\top` of every head's Jacobian, all heads together.

    With :math:`C^h` the head's block of :math:`\bar W_o\operatorname{blockdiag}(\bar W_v)`
    ``[D_out, D]``, the output's Jacobian in :math:`x_j` is
    :math:`\sum_h p^h_{ij}C^h + \sum_h a^hb^{h\top}` with :math:`a^h = C^hG^h_{ij}`,
    :math:`b^h = g^h_i`; besides the :math:`\sum_hp^hC^h` term (added by the caller) its
    diagonal variance is :math:`2\sum_{hh'}p^{h'}a^h_k(C^{h'}(b^h\circ v_j))_k
    + \sum_{hh'}a^h_ka^{h'}_k\,b^{h\top}\operatorname{diag}(v_j)b^{h'}`, summed over
    :math:`j`. ``[B, T_q, D_out]``.
    """
    g_big, g, _ = parts
    a = torch.einsum("khc,bhijc->bijhk", c_heads, g_big)
    bs = g.unsqueeze(-2) * var.unsqueeze(1).unsqueeze(2)  # [B, H, Tq, Tk, D]
    cb = torch.einsum("kgc,bhijc->bijhgk", c_heads, bs)
    cross = 2 * torch.einsum("bgij,bijhk,bijhgk->bik", p, a, cb)
    bb = torch.einsum("bhic,bgic,bjc->bijhg", g, g, var)
    quad = torch.einsum("bijhk,bijgk,bijhg->bik", a, a, bb)
    return cross + quad


def _query_path_through_heads(
    p: Tensor,
    parts: tuple[Tensor, Tensor, Tensor],
    kh: Tensor,
    query: ProjectionMoments,
    var: Tensor,
    c_heads: Tensor,
) -> Tensor:
    r"""The output variance from the query path :math:`R_i` of :math:`\partial z_i/\partial x_i`, all heads together.

    A token moves its own attention weights through its query. With
    :math:`K_i = \sum_h C^h(p^h_{ii}I + G^h_{ii}g^{h\top}_i)` (counted by the caller) and
    :math:`Q_i = \sum_h C^hR^h_i = \sum_h\sum_l (C^hG^h_{il})\tilde k^{h\top}_l`
    (:math:`\tilde k_l = M_q^{h\top}\bar k_l/\sqrt d`), the output's Jacobian in :math:`x_i` is
    :math:`K_i + Q_i` and what :math:`Q_i` adds to its diagonal variance is
    :math:`\operatorname{diag}(Q_iS_iQ_i^\top + 2K_iS_iQ_i^\top)`, with the correlations
    that :math:`R_i` gives the features of :math:`z_i` (dropping them, as a diagonal
    :math:`z`, misses outputs where the token's variance cancels). ``[B, T_q, D_out]``.
    """
    g_big, g, _ = parts
    heads, d = kh.shape[1], kh.shape[-1]
    k_tilde = torch.einsum("bhlr,hrc->bhlc", kh, query.w_loc.reshape(heads, d, -1)) / math.sqrt(d)
    a = torch.einsum("khc,bhilc->bihlk", c_heads, g_big)  # C^h G^h_il: [B, Tq, H, Tk, D_out]
    q_path = torch.einsum("bihlk,bhlc->bikc", a, k_tilde)  # [B, Tq, D_out, D]
    own = a.diagonal(0, 1, 3).permute(0, 3, 2, 1)  # C^h G^h_ii: [B, T, D_out, H]
    p_ii = p.diagonal(0, -2, -1).transpose(1, 2)  # [B, T, H]
    k_i = torch.einsum("bih,khc->bikc", p_ii, c_heads)
    k_i = k_i + torch.einsum("bikh,bhic->bikc", own, g)
    return ((q_path * q_path + 2 * k_i * q_path) * var.unsqueeze(-2)).sum(-1)


def input_jacobian_full(
    weights: AttentionWeights, parts: tuple[Tensor, Tensor, Tensor], cov: Tensor
) -> Tensor:
    r""":math:`\sum_j J^h_{ij}S_jJ^{h'\top}_{ij}` for every pair of heads, ``[B, T_q, H, D, H, D]``."""
    g_big, g, r = parts
    p = weights.mean
    d = g.shape[-1]
    eye = torch.eye(d, dtype=p.dtype, device=p.device)
    jac = p[..., None, None] * eye + g_big.unsqueeze(-1) * g.unsqueeze(-2).unsqueeze(-3)
    jac = jac + _on_diagonal(r, jac.shape)
    return torch.einsum("bhijcd,bjde,bgijfe->bihcgf", jac, cov, jac)


def _on_diagonal(r: Tensor, shape: torch.Size) -> Tensor:
    """``R_i`` placed at ``j = i`` of a ``[B, H, Tq, Tk, D, D]`` tensor."""
    t = shape[2]
    eye = torch.eye(t, dtype=r.dtype, device=r.device)
    return eye[:, :, None, None] * r.unsqueeze(3)


def self_attention_weights(
    mean: Tensor,
    second: Tensor | None,
    query: ProjectionMoments,
    key: ProjectionMoments,
    *,
    heads: int,
    rule: AttentionRule = "unscented",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> AttentionWeights:
    """The attention weights' moments of :func:`self_attention_moments` (same arguments)."""
    return _weights_and_heads(mean, second, query, key, heads, rule, causal, key_padding_mask)[0]


def self_attention_moments(
    mean: Tensor,
    second: Tensor | None,
    query: ProjectionMoments,
    key: ProjectionMoments,
    value: ProjectionMoments,
    output: ProjectionMoments,
    *,
    heads: int,
    rule: AttentionRule = "unscented",
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Moments of multi-head self-attention :math:`W_o\,[o^1; \dots; o^H] + b_o` (module docstring).

    In ``diag`` storage the part of :math:`\operatorname{Cov}(z_i)` that the attention weights'
    fluctuation makes, :math:`F_iF_i^\top`, is strongly correlated across features; it is carried
    as factors through the mean value and output weights
    (:math:`\bar W_o\operatorname{blockdiag}(\bar W_v^h)F_i`) rather than dropped to its
    diagonal, so only the correlations the tokens' own variances make are dropped.

    Args:
        mean: token means ``[B, T, D]``.
        second: ``None`` (deterministic tokens), per-unit variances ``[B, T, D]`` (diag) or
            per-token covariances ``[B, T, D, D]`` (full).
        query: the query projection's weight moments (:class:`ProjectionMoments`).
        key: the key projection's.
        value: the value projection's.
        output: the output projection's.
        heads: :math:`H`, dividing the projections' output width.
        rule: ``"mean"`` (SUQ), ``"delta"``, ``"mean_field"`` or ``"unscented"`` (module
            docstring).
        causal: mask keys after the query.
        key_padding_mask: ``[B, T]`` bool, ``True`` where a token is padding.

    Returns:
        ``(mean [B, T, D_out], var [B, T, D_out])`` for a deterministic or diag input,
        ``(mean, cov [B, T, D_out, D_out])`` for a full one.
    """
    full = second is not None and second.dim() == mean.dim() + 1
    if value.w_loc.shape[0] % heads:
        raise ValueError(f"the value width must be a multiple of heads={heads}")
    if rule == "mean" and not full:
        return _mean_rule_diag(
            mean, second, query, key, value, output, heads, causal, key_padding_mask
        )
    weights, qh, kh = _weights_and_heads(
        mean, second, query, key, heads, rule, causal, key_padding_mask
    )
    var = None if second is None else (second.diagonal(0, -2, -1) if full else second)
    block = value_weights(value, heads)
    coupling = None
    if rule != "mean" and second is not None and mean.shape[-2] > 1:
        coupling = _input_coupling(weights, qh, kh, query, key, second, full)
    if full:
        assert second is not None
        jacobian = None
        if rule != "mean" and mean.shape[-2] > 1:
            jacobian = input_jacobian_full(
                weights, _jacobian_parts(weights, qh, kh, query, key, mean), second
            )
        z_mean, z_cov = mix_tokens_full(weights, mean, second, jacobian)
        if coupling is not None:
            z_mean = z_mean + coupling.transpose(1, 2).flatten(-2)
        o_mean, o_cov = _project(z_mean, z_cov, block, True)
        out_mean, out_cov = _project(o_mean, o_cov, output, True)
        return flush(out_mean), flush(out_cov)
    zm, zv = mix_tokens_diag(weights, mean, torch.zeros_like(mean) if var is None else var)
    factors = weight_fluctuation_factors(weights, mean)  # [B, H, Tq, D, K] or None
    minus: Tensor | None = None
    weight_factors = factors
    parts: tuple[Tensor, Tensor, Tensor] | None = None
    query_path: Tensor | None = None
    if coupling is not None:
        assert var is not None
        zm = zm + coupling
        parts = _jacobian_parts(weights, qh, kh, query, key, mean)
        extra, input_factors, minus = input_jacobian_diag(weights, parts, var)
        zv = zv + extra
        query_path = extra.transpose(1, 2).flatten(-2)
        factors = input_factors if factors is None else torch.cat([factors, input_factors], -1)
    z_mean, z_var = zm.transpose(1, 2).flatten(-2), zv.transpose(1, 2).flatten(-2)
    # The value and output projections are two linear maps in a row: their mean weights act as
    # one map C = W_o blockdiag(W_v^h) on z's independent part and on its factors, so the
    # correlations that W_v gives o are not dropped before W_o (only z's are, by design).
    w_sq = block.w_loc * block.w_loc

    def marginal(f: Tensor | None, dims: int) -> Tensor:
        return z_var.new_zeros(()) if f is None else (f * f).sum(-1).flatten(-dims)

    def signed(f: Tensor | None, g: Tensor | None, dims: int) -> Tensor:
        return marginal(f, dims) - marginal(g, dims)

    lz = (
        signed(factors, minus, 1).transpose(1, 2).flatten(-2)
        if factors is not None
        else marginal(None, 1)
    )
    o_mean, o_var = _project(z_mean, z_var + lz, block, False)
    o_weight_var = o_var - (z_var + lz) @ w_sq.transpose(-1, -2)  # from W_v's variances
    o_var = o_weight_var + z_var @ w_sq.transpose(-1, -2)
    fo = fo_minus = None
    d_head = value.w_loc.shape[0] // heads
    w_heads = value.w_loc.reshape(heads, d_head, -1)  # [H, d, D]
    if factors is not None:
        fo = torch.einsum("hrc,bhick->bihrk", w_heads, factors)  # [B, Tq, H, d, K]
    if minus is not None:
        fo_minus = torch.einsum("hrc,bhick->bihrk", w_heads, minus)
    o_var = o_var + signed(fo, fo_minus, 2)
    o_var = o_var.clamp_min(0)
    out_mean, out_var = _project(o_mean, o_var, output, False)
    wo_sq = output.w_loc * output.w_loc
    combined = output.w_loc @ block.w_loc  # [D_out, H*D]
    out_var = out_var - o_var @ wo_sq.transpose(-1, -2)
    out_var = out_var + o_weight_var.clamp_min(0) @ wo_sq.transpose(-1, -2)
    # z's independent part: the heads mix the same tokens, so sum_j p^h_ij p^h'_ij v_j couples
    # the heads' rows of C; what is left (the weights' second-order part, the query path) per head
    token_var = torch.zeros_like(mean) if var is None else var
    a = weights.mean
    same = (a * a) @ token_var.unsqueeze(1)  # [B, H, Tq, D]
    rest = z_var - same.transpose(1, 2).flatten(-2)
    if query_path is not None:  # carried with its correlations below
        rest = rest - query_path
    out_var = out_var + rest @ (combined * combined).transpose(-1, -2)
    c_heads = combined.reshape(combined.shape[0], heads, -1)  # [D_out, H, D]
    # sum_{h,g,c} (sum_j a^h_ij a^g_ij v_jc) C_khc C_kgc, as two matrix products: the pairs'
    # weights [B, H, G, Tq, Tk] times the variances, then times the pairs' C_khc C_kgc
    hh = a.unsqueeze(2) * a.unsqueeze(1)
    pair = (hh.flatten(1, 3) @ token_var).unflatten(1, hh.shape[1:4])  # [B, H, G, Tq, D]
    cc = (c_heads.unsqueeze(2) * c_heads.unsqueeze(1)).flatten(1)  # [D_out, H * G * D]
    out_var = out_var + pair.permute(0, 3, 1, 2, 4).flatten(2) @ cc.transpose(0, 1)
    w_out = output.w_loc.reshape(output.w_loc.shape[0], heads, -1)  # [D_out, H, d]
    if weight_factors is not None:  # the heads' weight fluctuations are independent
        fw = torch.einsum("hrc,bhick->bihrk", w_heads, weight_factors)
        fout = torch.einsum("ohr,bihrk->biohk", w_out, fw).flatten(-2)  # [B, Tq, D_out, H*K]
        out_var = out_var + (fout * fout).sum(-1)
    if parts is not None:  # the tokens' variance through every head at once
        out_var = out_var + _input_through_heads(a, parts, token_var, c_heads)
        out_var = out_var + _query_path_through_heads(a, parts, kh, query, token_var, c_heads)
    return flush(out_mean), flush(out_var.clamp_min(0))


def _mean_rule_diag(
    mean: Tensor,
    var: Tensor | None,
    query: ProjectionMoments,
    key: ProjectionMoments,
    value: ProjectionMoments,
    output: ProjectionMoments,
    heads: int,
    causal: bool,
    key_padding_mask: Tensor | None,
) -> tuple[Tensor, Tensor]:
    r"""SUQ's rule in ``diag`` storage, the terms that are not zero for it, and nothing else.

    The same moments as the general path of :func:`self_attention_moments` (to rounding;
    ``tests/test_attention.py``), whose terms for the attention weights' fluctuation, the
    tokens' variance through the weights and the query path all vanish under
    :math:`A = \operatorname{softmax}(\bar q\bar k^\top/\sqrt d)`. With
    :math:`\bar z^h_i = \sum_j A^h_{ij}\bar x_j`, :math:`s^h_i = \sum_j (A^h_{ij})^2 v_j`,
    :math:`B = \operatorname{blockdiag}_h(W_v^h)` (means :math:`M_v`, variances :math:`V_v`),
    :math:`C = M_o M_v`:

    .. math::
        u &= (\bar z^2 + s)V_v^\top + \sigma_{b_v}^2
            &&\text{(the value weights' part of } \operatorname{Var} o),\\
        \operatorname{Var} o &= u + s\,(M_v^{\circ 2})^\top,\qquad E[o] = \bar zM_v^\top + b_v,\\
        \operatorname{Var} y_k &= (E[o]^2 + \operatorname{Var} o)V_o^\top + \sigma_{b_o}^2
            + u\,(M_o^{\circ 2})^\top
            + \sum_{h,g,c}\Big(\sum_j A^h_{ij}A^g_{ij}v_{jc}\Big)C_{khc}C_{kgc},

    the last term the tokens' variance through the mean weights, the heads coupled (they mix
    the same tokens).

    Computed with the mixings of every head as one batched product and the value projection
    through block-diagonal value weights; the coupled term over the head pairs
    :math:`h < g` twice (the :math:`h = g` terms are :math:`s`'s): about forty tensor
    operations.
    """
    linear = torch.nn.functional.linear
    t = mean.shape[-2]
    allowed = attention_mask(t, t, causal, key_padding_mask, mean.device)
    qh = split_heads(linear(mean, query.w_loc, query.b_loc), heads)
    kh = split_heads(linear(mean, key.w_loc, key.b_loc), heads)
    scores = (qh @ kh.transpose(-1, -2)) * (1.0 / math.sqrt(qh.shape[-1]))
    a = torch.softmax(_masked(scores, allowed, float("-inf")), -1)  # [B, H, Tq, Tk]
    rows = a.flatten(1, 2)  # [B, H*Tq, Tk]: every head's mixing in one batched product

    def by_token(x: Tensor) -> Tensor:  # [B, H*Tq, D] -> [B, Tq, H*D]
        merged: Tensor = x.unflatten(1, (heads, t)).transpose(1, 2).flatten(2)
        return merged

    z_mean = by_token(rows @ mean)
    s = None if var is None else by_token(flush((rows * rows) @ var))  # sum_j A^2 v_j
    z_second = z_mean * z_mean if s is None else torch.addcmul(s, z_mean, z_mean)
    block = value_weights(value, heads)
    o_mean = linear(z_mean, block.w_loc, value.b_loc)  # E[o] = z-bar M_v^T + b_v
    u = None  # (z-bar^2 + s) V_v^T + sigma_bv^2, [B, Tq, H*d_v]
    if block.w_var is not None:
        u = z_second @ block.w_var.transpose(-1, -2)
    if value.b_var is not None:
        u = value.b_var.expand_as(o_mean) if u is None else u + value.b_var
    o_var = u
    if s is not None:
        through = s @ (block.w_loc * block.w_loc).transpose(-1, -2)  # s (M_v^2)^T
        o_var = through if o_var is None else o_var + through
    m_o = output.w_loc
    out_mean = linear(o_mean, m_o, output.b_loc)
    o_second = o_mean * o_mean if o_var is None else torch.addcmul(o_var, o_mean, o_mean)
    out_var = None if output.w_var is None else o_second @ output.w_var.transpose(-1, -2)
    if output.b_var is not None:
        out_var = output.b_var.expand_as(out_mean) if out_var is None else out_var + output.b_var
    if u is not None:
        through_o = u @ (m_o * m_o).transpose(-1, -2)
        out_var = through_o if out_var is None else out_var + through_o
    if s is not None and var is not None:
        # C_h = M_o^h M_v^h [D_out, D], heads coupled through the tokens they share; the
        # (h, g) and (g, h) terms are equal and the h = g ones are s's: the pairs h < g twice
        c_heads = (m_o @ block.w_loc).unflatten(1, (heads, -1))  # [D_out, H, D]
        coupled = s @ (c_heads * c_heads).flatten(1).transpose(0, 1)
        if heads > 1:
            first, second = torch.triu_indices(heads, heads, 1, device=mean.device).unbind(0)
            cross = a.index_select(1, first) * a.index_select(1, second)  # [B, P, Tq, Tk]
            pairs = cross.shape[1]
            x_pair = (cross.flatten(1, 2) @ var).unflatten(1, (pairs, t)).transpose(1, 2)
            cc = c_heads.index_select(1, first) * c_heads.index_select(1, second)  # [D_out, P, D]
            coupled = torch.addmm(
                coupled.flatten(0, 1), x_pair.flatten(2).flatten(0, 1), cc.flatten(1).t(), alpha=2
            ).view_as(coupled)
        out_var = coupled if out_var is None else out_var + coupled
    if out_var is None:
        out_var = torch.zeros_like(out_mean)
    return flush(out_mean), flush(out_var.clamp_min(0))


def attention_sample(
    x: Tensor,
    query: tuple[Tensor, Tensor | None],
    key: tuple[Tensor, Tensor | None],
    value: tuple[Tensor, Tensor | None],
    output: tuple[Tensor, Tensor | None],
    *,
    heads: int,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """Self-attention for given weights (a draw per leading sample, or plain values).

    Args:
        x: tokens ``[..., B, T, D]``.
        query: ``(weight [..., out, in], bias [..., out] or None)``; a leading sample
            dimension of the weights lines up with ``x``'s first dimension.
        key: as ``query``.
        value: as ``query``.
        output: as ``query``.
        heads: the number of heads.
        causal: mask keys after the query.
        key_padding_mask: ``[B, T]`` bool, ``True`` where a token is padding.
    """

    def affine(h: Tensor, wb: tuple[Tensor, Tensor | None]) -> Tensor:
        w, bias = wb
        extra = h.dim() - w.dim()  # align a sample dimension of w with h's first
        if w.dim() > 2:
            w = w.reshape(w.shape[0], *([1] * extra), *w.shape[1:])
        out = h @ w.transpose(-1, -2)
        if bias is not None:
            if bias.dim() > 1:
                bias = bias.reshape(bias.shape[0], *([1] * (out.dim() - 2)), bias.shape[-1])
            out = out + bias
        return out

    q = split_heads(affine(x, query), heads)
    k = split_heads(affine(x, key), heads)
    v = split_heads(affine(x, value), heads)
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    allowed = attention_mask(x.shape[-2], x.shape[-2], causal, key_padding_mask, x.device)
    scores = _masked(scores, allowed, float("-inf"))
    return affine(merge_heads(torch.softmax(scores, -1) @ v), output)
