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

**dDVI backward.** :func:`linear_diag` (the layer of every dDVI step) runs its forward formula
in a custom autograd function whose backward is written out: with :math:`\bar m, \bar v` the
output gradients, :math:`s = E[h^2] = m^2 + v`,

.. math::
    \partial_m = \bar m M + 2m \odot (\bar v V),\quad
    \partial_v = \bar v (V + M^{\circ 2}),\quad
    \partial_M = \bar m^\top m + 2M \odot (\bar v^\top v),\quad
    \partial_V = \bar v^\top s,

and the bias gradients are batch sums. That is ten kernels where autograd through the formula
dispatches about thirty (a node per op, a transpose per matmul, gradient accumulations): the
dDVI step is bound by that count on a GPU and ~2.5 us per op on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

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
    return _affine(x, w_loc, b_loc), _affine(x * x, w_var, b_var)


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
    the module docstring (one autograd node); batched weights, broadcast inputs, ``torch.func``
    transforms and export differentiate the same formula with autograd.
    """
    closed_form = (
        w_loc.dim() == 2
        and w_var.shape == w_loc.shape
        and mean.shape == var.shape
        and mean.dim() >= 1
        and (b_loc is None or b_loc.dim() == 1)
        and (b_var is None or b_var.dim() == 1)
        and not torch._C._are_functorch_transforms_active()
        and not torch.compiler.is_exporting()
    )
    if closed_form:
        return _LinearDiag.apply(mean, var, w_loc, w_var, b_loc, b_var)  # type: ignore[no-any-return]  # Function.apply returns Any
    return _linear_diag_formula(mean, var, w_loc, w_var, b_loc, b_var)[:2]


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
    diag = _affine(torch.addcmul(var, mean, mean), w_var, b_var)
    k, d = w_loc.shape[-2:]
    if w_loc.dim() == 2 and k <= NARROW_OUTPUTS:
        # the [D, K^2] products M_kd M_ld once, then one [..., D] x [D, K^2] matmul: 1.2-3.5x
        # faster forward+backward than the per-example [K, D] x [D, K] products for a K = 10
        # head (B = 128..1401, D = 64..400, one CPU thread)
        pairs = (w_loc.mT.unsqueeze(-1) * w_loc.mT.unsqueeze(-2)).reshape(d, k * k)
        out_cov = (var @ pairs).reshape(*var.shape[:-1], k, k)
    else:
        out_cov = (w_loc * var.unsqueeze(-2)) @ w_loc.transpose(-1, -2)
    out_cov = symmetrize(out_cov)
    return _affine(mean, w_loc, b_loc), _plus_diagonal(out_cov, diag)
