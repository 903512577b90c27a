r"""Moments of a linear layer with factorised Gaussian weights (paper eq. 2, appendix A).

For :math:`a_k = \sum_j h_j W_{kj} + b_k` with independent :math:`W_{kj} \sim
\mathcal N(M_{kj}, V_{kj})`, :math:`b_k \sim \mathcal N(c_k, u_k)` and input :math:`h`
independent of the weights:

.. math::
    E[a] = E[h] M^\top + c,\qquad
    \operatorname{Cov}(a) = \operatorname{diag}\!\big(E[h^2] V^\top + u\big)
        + M \operatorname{Cov}(h) M^\top .

Weights use the ``torch.nn.Linear`` layout ``[out_features, in_features]``. Everything is a
batched matmul; no loops over units.

**Fused backward.** The dDVI layer and the narrow full-covariance head fed independent inputs
run their formula in one custom autograd function whose backward is written out
(when :func:`.policy.use_fused` allows: eager mode, plain tensors, 2-D weights, 1-D biases).
With :math:`\bar m, \bar v, \bar C` the output gradients and :math:`s = E[h^2] = m^2 + v`:

* dDVI (:func:`linear_diag`): :math:`\partial_m = \bar m M + 2m \odot (\bar v V)`,
  :math:`\partial_v = \bar v (V + M^{\circ 2})`,
  :math:`\partial_M = \bar m^\top m + 2M \odot (\bar v^\top v)`,
  :math:`\partial_V = \bar v^\top s`;
* full output from a diagonal input (:func:`linear_full_from_diag`, narrow outputs):
  :math:`C_{kl} = \sum_d v_d M_{kd} M_{ld} + \delta_{kl}(s V^\top + u)_k`, so with
  :math:`g = \operatorname{diag}\bar C`: :math:`\partial_m = \bar m M + 2m \odot (gV)`,
  :math:`\partial_{v_d} = (gV)_d + \sum_{kl}\bar C_{kl}M_{kd}M_{ld}`,
  :math:`\partial_{M_{kd}} = (\bar m^\top m)_{kd} + \sum_l (H_{kld} + H_{lkd}) M_{ld}` with
  :math:`H_{kld} = \sum_b \bar C_{bkl} v_{bd}`, and :math:`\partial_V = g^\top s`
  (:math:`C` is symmetric by construction, so its symmetrisation changes no gradient);

and the bias gradients are batch sums. That is about ten kernels per layer where autograd
through the formula dispatches about thirty (a node per op, a transpose per matmul, gradient
accumulations): an eager step at small sizes is bound by that count. A layer fed data
(:func:`linear_deterministic`, an input without gradient) has one too, with
:math:`\partial_M = \bar m^\top x` and :math:`\partial_V = \bar v^\top x^{\circ 2}`:
six backward ops where autograd's two ``addmm`` nodes and their transposes take fourteen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from . import policy
from ._cache import cached
from .special import flush

__all__ = [
    "linear_deterministic",
    "linear_diag",
    "linear_full",
    "linear_full_from_diag",
    "symmetrize",
]


def symmetrize(cov: Tensor) -> Tensor:
    """Average a covariance with its transpose, removing matmul round-off asymmetry."""
    return (cov + cov.transpose(-1, -2)).mul_(0.5)


def _plus_diagonal(cov: Tensor, diag: Tensor) -> Tensor:
    # In place on a fresh tensor: diag_embed + add would allocate (and page-fault) two more
    # [..., D, D] arrays. Autograd records the diagonal add as a view update.
    if torch.compiler.is_exporting():  # the ONNX exporter cannot functionalise a view update
        return cov + torch.diag_embed(diag)
    cov.diagonal(dim1=-2, dim2=-1).add_(diag)
    return cov


def _affine(x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """``x @ w.T + b``; one fused ``F.linear`` (addmm) node for the usual 2-D weight."""
    if w.dim() == 2 and (b is None or b.dim() <= 1):
        return F.linear(x, w, b)
    out = x @ w.transpose(-1, -2)
    return out if b is None else out + b


def _plus_affine(acc: Tensor, x: Tensor, w: Tensor) -> Tensor:
    """``acc + x @ w.T``; one ``addmm`` for 2-D operands."""
    if x.dim() == 2 and w.dim() == 2 and acc.dim() == 2:
        return torch.addmm(acc, x, w.t())
    return acc + _affine(x, w)


def _gram(a: Tensor, b: Tensor) -> Tensor:
    r""":math:`a^\top b` for row-major ``a [rows, p]`` and ``b [rows, q]``: the narrower one transposed.

    The same product either way, :math:`a^\top b = (b^\top a)^\top`, summed in another order
    (equal to rounding). Only the execution differs: MKL's ``sgemm`` takes 4-6x longer with the
    wider operand transposed first on the AMD EPYC measured (``[1024, 100]^T [1024, 9]``: 362
    against 67 us, torch 2.13.0+cpu, 1 thread) and no faster in the other shapes measured.
    The result is then a transposed view, which autograd copies into the parameter's layout:
    an extra op that costs more than it saves on small products (below :math:`2^{16}`
    multiply-adds), where the order is left alone.
    """
    if b.shape[-1] < a.shape[-1] and a.shape[0] * a.shape[1] * b.shape[1] >= 2**16:
        return (b.t() @ a).t()
    return a.t() @ b


def linear_deterministic(
    x: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None = None,
    b_var: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of :math:`xW^\top + b` for a deterministic input ``x [..., Din]``.

    The output units are independent (each has its own weights), so the covariance is
    diagonal: :math:`\operatorname{Var}(a) = x^2 V^\top + u`.

    Returns:
        ``(mean [..., Dout], var [..., Dout])``.
    """
    if (
        not x.requires_grad
        and x.dim() >= 1
        and w_loc.dim() == 2
        and w_var.shape == w_loc.shape
        and (b_loc is None or b_loc.dim() == 1)
        and (b_var is None or b_var.dim() == 1)
        and policy.use_fused(x, w_loc, w_var, b_loc, b_var)
    ):
        return _LinearDeterministic.apply(x, w_loc, w_var, b_loc, b_var)  # type: ignore[no-any-return]  # Function.apply returns Any
    return _affine(x, w_loc, b_loc), _affine(x * x, w_var, b_var)


class _LinearDeterministic(torch.autograd.Function):
    r""":func:`linear_deterministic` for a data input (no input gradient), backward written out.

    :math:`\partial_M = \bar m^\top x`, :math:`\partial_V = \bar v^\top x^{\circ 2}` and the
    bias gradients are batch sums: six aten ops where autograd's two ``addmm`` nodes and their
    transposes dispatch about fourteen (the first layer of every network; no ``flush``, as
    autograd's product has none).
    """

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        x: Tensor,
        w_loc: Tensor,
        w_var: Tensor,
        b_loc: Tensor | None,
        b_var: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        x_sq = x * x
        ctx.save_for_backward(x, x_sq)
        return _affine(x, w_loc, b_loc), _affine(x_sq, w_var, b_var)

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_mean: Tensor, g_var: Tensor) -> tuple[Tensor | None, ...]:
        x, x_sq = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        need = ctx.needs_input_grad  # type: ignore[attr-defined]  # FunctionCtx declares no needs_input_grad
        g_mean, g_var = _rows(g_mean), _rows(g_var)
        d_w_loc = _gram(g_mean, _rows(x)) if need[1] else None
        d_w_var = _gram(g_var, _rows(x_sq)) if need[2] else None
        d_b_loc = g_mean.sum(0) if need[3] else None
        d_b_var = g_var.sum(0) if need[4] else None
        return None, d_w_loc, d_w_var, d_b_loc, d_b_var


def _plain_layout(
    mean: Tensor,
    var: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None,
    b_var: Tensor | None,
) -> bool:
    """The layout the closed-form backward passes are written for: 2-D weights, 1-D biases."""
    return (
        w_loc.dim() == 2
        and w_var.shape == w_loc.shape
        and mean.shape == var.shape
        and mean.dim() >= 1
        and (b_loc is None or b_loc.dim() == 1)
        and (b_var is None or b_var.dim() == 1)
    )


def linear_diag(
    mean: Tensor,
    var: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None = None,
    b_var: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""DDVI linear layer: input units treated as independent.

    :math:`\operatorname{Var}(a) = (E[h]^2 + \operatorname{Var} h)\,V^\top
    + \operatorname{Var}(h)\,(M^{\circ 2})^\top + u`.

    With 2-D weights and 1-D biases (every declared layer) the backward is the closed form of
    the module docstring (one autograd node) where :func:`.policy.use_fused` allows; batched
    weights, broadcast inputs, ``torch.compile``, ``torch.func`` transforms and export
    differentiate the same formula with autograd.
    """
    if _plain_layout(mean, var, w_loc, w_var, b_loc, b_var) and policy.use_fused(
        mean, var, w_loc, w_var, b_loc, b_var
    ):
        args = (mean, var, w_loc, w_var, b_loc, b_var)
        if not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in args)):
            return _linear_diag_inference(mean, var, w_loc, w_var, b_loc, b_var)
        return _LinearDiag.apply(mean, var, w_loc, w_var, b_loc, b_var)  # type: ignore[no-any-return]  # Function.apply returns Any
    return _linear_diag_formula(mean, var, w_loc, w_var, b_loc, b_var)[:2]


def _linear_diag_inference(
    mean: Tensor,
    var: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None,
    b_var: Tensor | None,
) -> tuple[Tensor, Tensor]:
    r""":func:`linear_diag` with nothing to differentiate: the variance as one matmul.

    :math:`(v + m^2)V^\top + v(M^{\circ 2})^\top + u = [v,\ m^2]\,[M^{\circ 2} + V,\ V]^\top + u`,
    the same formula regrouped (equal to rounding, ``tests/test_moments_linear.py``): one
    ``addmm`` over the concatenated ``[rows, 2 D_in]`` input instead of two, and no autograd
    node.
    """
    rows_m, rows_v = _rows(mean), _rows(var)
    both = torch.cat([rows_v, rows_m * rows_m], -1)
    weights = torch.cat([torch.addcmul(w_var, w_loc, w_loc), w_var], -1)
    out_var = both @ weights.t() if b_var is None else torch.addmm(b_var, both, weights.t())
    shape = (*mean.shape[:-1], w_loc.shape[0])
    return F.linear(mean, w_loc, b_loc), out_var.view(shape)


def _linear_diag_formula(
    mean: Tensor,
    var: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None,
    b_var: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mean, var)`` of :func:`linear_diag`, and the ``(E[h^2], M^2)`` the backward reuses."""
    second = torch.addcmul(var, mean, mean)  # E[h^2]
    w_sq = w_loc * w_loc
    out_var = _plus_affine(_affine(second, w_var, b_var), var, w_sq)
    return _affine(mean, w_loc, b_loc), out_var, second, w_sq


def _rows(x: Tensor) -> Tensor:
    """``x`` as ``[rows, features]`` (the batch dimensions flattened)."""
    return x if x.dim() == 2 else x.reshape(-1, x.shape[-1])


class _LinearDiag(torch.autograd.Function):
    """:func:`_linear_diag_formula` with the closed-form backward of the module docstring."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        mean: Tensor,
        var: Tensor,
        w_loc: Tensor,
        w_var: Tensor,
        b_loc: Tensor | None,
        b_var: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        out_mean, out_var, second, w_sq = _linear_diag_formula(
            mean, var, w_loc, w_var, b_loc, b_var
        )
        ctx.save_for_backward(mean, var, w_loc, w_var, second, w_sq)
        return out_mean, out_var

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_mean: Tensor, g_var: Tensor) -> tuple[Tensor | None, ...]:
        mean, var, w_loc, w_var, second, w_sq = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        need = ctx.needs_input_grad  # type: ignore[attr-defined]  # FunctionCtx declares no needs_input_grad
        d_mean = d_var = d_w_loc = d_w_var = d_b_loc = d_b_var = None
        if need[0] or need[1]:
            through_v = g_var @ w_var  # dVar/dv via V, also half of dVar/dm / m
            if need[0]:
                d_mean = torch.addcmul(g_mean @ w_loc, mean, through_v, value=2)
            if need[1]:
                d_var = torch.addmm(_rows(through_v), _rows(g_var), w_sq)
                d_var = d_var if var.dim() == 2 else d_var.view(var.shape)
        g_mean_t, g_var_t = _rows(g_mean).t(), _rows(g_var).t()
        # the weight gradients sum products of tail values with small output gradients: flush
        if need[2]:
            d_w_loc = torch.addcmul(g_mean_t @ _rows(mean), w_loc, g_var_t @ _rows(var), value=2)
            d_w_loc = flush(d_w_loc)
        if need[3]:
            d_w_var = flush(g_var_t @ _rows(second))
        if need[4]:
            d_b_loc = _rows(g_mean).sum(0)
        if need[5]:
            d_b_var = _rows(g_var).sum(0)
        return d_mean, d_var, d_w_loc, d_w_var, d_b_loc, d_b_var


def linear_full(
    mean: Tensor,
    cov: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None = None,
    b_var: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""DVI linear layer with a full input covariance ``cov [..., Din, Din]``.

    :math:`\operatorname{Cov}(a) = \operatorname{diag}(E[h^2]V^\top + u) + M\Sigma_h M^\top`.
    """
    diag = _affine(torch.addcmul(cov.diagonal(dim1=-2, dim2=-1), mean, mean), w_var, b_var)
    out_cov = symmetrize(w_loc @ cov @ w_loc.transpose(-1, -2))
    return _affine(mean, w_loc, b_loc), _plus_diagonal(out_cov, diag)


#: Output widths up to which :func:`linear_full_from_diag` forms the covariance from the
#: ``[D_in, D_out^2]`` weight products (an execution choice; the same numbers up to round-off).
NARROW_OUTPUTS = 16


def linear_full_from_diag(
    mean: Tensor,
    var: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None = None,
    b_var: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    r"""Full output covariance for an input whose covariance is exactly diagonal.

    Same result as :func:`linear_full` with ``cov = diag(var)``, but
    :math:`M\operatorname{diag}(v)M^\top` costs one ``[Dout, Din] x [Din, Dout]`` product per
    example instead of two ``Din``-square ones. This is the second layer of every network: a
    deterministic input makes the first layer's covariance, and its activation's, diagonal.
    """
    narrow = w_loc.dim() == 2 and w_loc.shape[-2] <= NARROW_OUTPUTS
    if (
        narrow
        and _plain_layout(mean, var, w_loc, w_var, b_loc, b_var)
        and policy.use_fused(mean, var, w_loc, w_var, b_loc, b_var)
    ):
        return _LinearFullFromDiag.apply(mean, var, w_loc, w_var, b_loc, b_var)  # type: ignore[no-any-return]  # Function.apply returns Any
    return _linear_full_from_diag_formula(mean, var, w_loc, w_var, b_loc, b_var)[:2]


def _linear_full_from_diag_formula(
    mean: Tensor,
    var: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None,
    b_var: Tensor | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """``(mean, cov)`` of :func:`linear_full_from_diag`, then what the backward reuses.

    That is ``E[h^2]`` and the ``[D, K^2]`` weight products (``None`` for wide outputs).
    """
    second = torch.addcmul(var, mean, mean)  # E[h^2]
    diag = _affine(second, w_var, b_var)
    k, d = w_loc.shape[-2:]
    pairs = None
    if w_loc.dim() == 2 and k <= NARROW_OUTPUTS:
        # the [D, K(K+1)/2] products M_kd M_ld of the distinct pairs k <= l once, then one
        # [..., D] x [D, K(K+1)/2] matmul, spread to the K^2 entries by one index_select: exactly
        # symmetric with no symmetrize pass. 1.2-3.5x faster forward+backward than the
        # per-example [K, D] x [D, K] products for a K = 10 head (B = 128..1401, D = 64..400,
        # one CPU thread)
        first, second_of_pair, spread = _pair_index(k, w_loc.device)
        w_t = w_loc.t()
        pairs = w_t.index_select(1, first) * w_t.index_select(1, second_of_pair)
        flat = (var if var.dim() == 2 else var.reshape(-1, d)) @ pairs
        out_cov = flat.index_select(1, spread).view(*var.shape[:-1], k, k)
    else:
        out_cov = symmetrize((w_loc * var.unsqueeze(-2)) @ w_loc.transpose(-1, -2))
    return _affine(mean, w_loc, b_loc), _plus_diagonal(out_cov, diag), second, pairs


_PAIR_INDEX: dict[tuple[int, torch.device], tuple[Tensor, Tensor, Tensor]] = {}


def _pair_fold(k: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """``[K^2, K(K+1)/2]`` 0/1 matrix: entry ``(k, l)`` of a ``[K, K]`` block to its pair."""

    def build() -> Tensor:
        spread = _pair_index(k, torch.device("cpu"))[2]
        fold = torch.zeros(k * k, k * (k + 1) // 2, dtype=dtype)
        fold[torch.arange(k * k), spread] = 1.0
        return fold.to(device)

    return cached(_PAIR_FOLD, (k, device, dtype), build)


_PAIR_FOLD: dict[tuple[int, torch.device, torch.dtype], Tensor] = {}


def _pair_index(k: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """Rows ``k``, ``l`` of the distinct pairs ``k <= l``, and each of the ``K^2`` entries' pair."""

    def build() -> tuple[Tensor, Tensor, Tensor]:
        rows, cols = torch.triu_indices(k, k)
        entry = torch.empty(k, k, dtype=torch.long)
        entry[rows, cols] = torch.arange(rows.numel())
        entry[cols, rows] = torch.arange(rows.numel())
        return rows.to(device), cols.to(device), entry.reshape(-1).to(device)

    return cached(_PAIR_INDEX, (k, device), build)


class _LinearFullFromDiag(torch.autograd.Function):
    """:func:`_linear_full_from_diag_formula` (narrow outputs) with the closed-form backward."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        mean: Tensor,
        var: Tensor,
        w_loc: Tensor,
        w_var: Tensor,
        b_loc: Tensor | None,
        b_var: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        out_mean, out_cov, second, pairs = _linear_full_from_diag_formula(
            mean, var, w_loc, w_var, b_loc, b_var
        )
        assert pairs is not None  # narrow outputs only (linear_full_from_diag's condition)
        ctx.save_for_backward(mean, var, w_loc, w_var, second, pairs)
        return out_mean, out_cov

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_mean: Tensor, g_cov: Tensor) -> tuple[Tensor | None, ...]:
        mean, var, w_loc, w_var, second, pairs = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        need = ctx.needs_input_grad  # type: ignore[attr-defined]  # FunctionCtx declares no needs_input_grad
        k = w_loc.shape[0]
        g_mean = _rows(g_mean)
        g_flat = g_cov.reshape(-1, k * k)  # [rows, K^2], the layout of the pairs' columns
        g_diag = g_flat[:, :: k + 1]  # the diagonal of each [K, K] gradient
        d_mean = d_var = d_w_loc = d_w_var = d_b_loc = d_b_var = None
        if need[0] or need[1]:
            through_v = g_diag @ w_var  # dC_kk/ds
            if need[0]:
                d_mean = torch.addcmul(g_mean @ w_loc, _rows(mean), through_v, value=2)
                d_mean = d_mean if mean.dim() == 2 else d_mean.view(mean.shape)
            if need[1]:
                # the distinct pairs' gradient summed over the K^2 entries that share one
                g_pairs = g_flat @ _pair_fold(k, g_flat.dtype, g_flat.device)
                d_var = torch.addmm(through_v, g_pairs, pairs.t())
                d_var = d_var if var.dim() == 2 else d_var.view(var.shape)
        if need[2]:
            # sum_l (H_kld + H_lkd) M_ld with H = g_flat^T v: the cov term, then the mean term
            h = (g_flat.t() @ _rows(var)).view(k, k, -1)
            d_w_loc = ((h + h.transpose(0, 1)) * w_loc).sum(1)
            d_w_loc = flush(d_w_loc.addmm_(g_mean.t(), _rows(mean)))
        if need[3]:
            d_w_var = flush(g_diag.t() @ _rows(second))
        if need[4]:
            d_b_loc = g_mean.sum(0)
        if need[5]:
            d_b_var = g_diag.sum(0)
        return d_mean, d_var, d_w_loc, d_w_var, d_b_loc, d_b_var
