r"""Moments of a 2-D convolution with factorised Gaussian weights (the dDVI conv layer).

An output unit of a convolution is a linear unit whose inputs are one receptive field:
:math:`a_{o,p} = \sum_{c,u} W_{o,c,u}\,h_{c,p+u} + b_o`. With independent
:math:`W_{o,c,u} \sim \mathcal N(M_{o,c,u}, V_{o,c,u})`, :math:`b_o \sim \mathcal N(c_o, u_o)`,
weights independent of the input and the input units treated as independent (the diagonal,
dDVI, approximation), each product has

.. math::
    \operatorname{Var}(W h) = E[W^2]E[h^2] - E[W]^2E[h]^2
        = V\,(E[h]^2 + \operatorname{Var} h) + M^2 \operatorname{Var} h ,

so, summing the independent terms of a receptive field,

.. math::
    E[a] = \operatorname{conv}(E[h], M) + c,\qquad
    \operatorname{Var}(a) = \operatorname{conv}(E[h]^2 + \operatorname{Var} h,\ V)
        + \operatorname{conv}(\operatorname{Var} h,\ M^{\circ 2}) + u .

Each weight enters an output unit once, so for independent inputs these marginal moments are
exact; only the covariances between output units (shared weights, overlapping receptive
fields) are dropped. For a deterministic input :math:`x` the variance is
:math:`\operatorname{conv}(x^2, V) + u`. Zero padding pads with deterministic zeros, which the
formulas above handle unchanged. Weights use the ``torch.nn.Conv2d`` layout
``[C_out, C_in, kH, kW]``; inputs are ``[B, C_in, H, W]``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from . import policy

__all__ = ["conv2d_deterministic", "conv2d_diag", "conv2d_sample"]

_Size = int | tuple[int, int]


def conv2d_deterministic(
    x: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None = None,
    b_var: Tensor | None = None,
    stride: _Size = 1,
    padding: _Size = 0,
) -> tuple[Tensor, Tensor]:
    r"""Mean and variance of the convolution of a deterministic input ``x [B, C_in, H, W]``.

    :math:`E[a] = \operatorname{conv}(x, M) + c`,
    :math:`\operatorname{Var}(a) = \operatorname{conv}(x^2, V) + u` (exact).

    Returns:
        ``(mean, var)``, each ``[B, C_out, H', W']``.
    """
    mean = F.conv2d(x, w_loc, b_loc, stride=stride, padding=padding)
    var = F.conv2d(x * x, w_var, b_var, stride=stride, padding=padding)
    return mean, var


def conv2d_diag(
    mean: Tensor,
    var: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None = None,
    b_var: Tensor | None = None,
    stride: _Size = 1,
    padding: _Size = 0,
) -> tuple[Tensor, Tensor]:
    r"""Diagonal (dDVI) convolution of independent Gaussian inputs, each ``[B, C_in, H, W]``.

    :math:`\operatorname{Var}(a) = \operatorname{conv}(E[h]^2 + \operatorname{Var} h, V)
    + \operatorname{conv}(\operatorname{Var} h, M^{\circ 2}) + u` (see the module docstring).

    **Fused backward** (one autograd node where :func:`.policy.use_fused` allows: eager mode,
    plain tensors, equal input shapes). With :math:`\bar m, \bar v` the output gradients,
    :math:`s = E[h]^2 + \operatorname{Var} h`, and :math:`\operatorname{conv}^\top_x`,
    :math:`\operatorname{conv}^\top_W` the input and kernel gradients of a convolution (one
    ``convolution_backward`` each):

    .. math::
        \partial_m = \operatorname{conv}^\top_x(\bar m; M)
            + 2m \odot \operatorname{conv}^\top_x(\bar v; V),\quad
        \partial_v = \operatorname{conv}^\top_x(\bar v; V)
            + \operatorname{conv}^\top_x(\bar v; M^{\circ 2}),

        \partial_M = \operatorname{conv}^\top_W(\bar m; m)
            + 2M \odot \operatorname{conv}^\top_W(\bar v; v),\quad
        \partial_V = \operatorname{conv}^\top_W(\bar v; s),

    and the bias gradients are the sums of :math:`\bar m, \bar v` over batch and pixels.
    Autograd through the formula adds a node, and its products, for :math:`s`, for
    :math:`M^{\circ 2}` and for the sum of the two variance terms.

    Returns:
        ``(mean, var)``, each ``[B, C_out, H', W']``.
    """
    if (
        mean.shape == var.shape
        and mean.dim() == 4
        and w_loc.dim() == 4
        and w_var.shape == w_loc.shape
        and (b_loc is None or b_loc.dim() == 1)
        and (b_var is None or b_var.dim() == 1)
        and policy.use_fused(mean, var, w_loc, w_var, b_loc, b_var)
    ):
        return _Conv2dDiag.apply(  # type: ignore[no-any-return]  # Function.apply returns Any
            mean, var, w_loc, w_var, b_loc, b_var, _pair(stride), _pair(padding)
        )
    return _conv2d_diag_formula(mean, var, w_loc, w_var, b_loc, b_var, stride, padding)[:2]


def _pair(v: _Size) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else (int(v[0]), int(v[1]))


def _conv2d_diag_formula(
    mean: Tensor,
    var: Tensor,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None,
    b_var: Tensor | None,
    stride: _Size,
    padding: _Size,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(mean, var)`` of :func:`conv2d_diag`, and the ``(E[h^2], M^2)`` its backward reuses."""
    out_mean = F.conv2d(mean, w_loc, b_loc, stride=stride, padding=padding)
    second = torch.addcmul(var, mean, mean)
    w_sq = w_loc * w_loc
    out_var = F.conv2d(second, w_var, b_var, stride=stride, padding=padding)
    out_var = out_var + F.conv2d(var, w_sq, None, stride=stride, padding=padding)
    return out_mean, out_var, second, w_sq


class _Conv2dDiag(torch.autograd.Function):
    """:func:`_conv2d_diag_formula` with the closed-form backward of :func:`conv2d_diag`."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        mean: Tensor,
        var: Tensor,
        w_loc: Tensor,
        w_var: Tensor,
        b_loc: Tensor | None,
        b_var: Tensor | None,
        stride: tuple[int, int],
        padding: tuple[int, int],
    ) -> tuple[Tensor, Tensor]:
        out_mean, out_var, second, w_sq = _conv2d_diag_formula(
            mean, var, w_loc, w_var, b_loc, b_var, stride, padding
        )
        ctx.save_for_backward(mean, var, w_loc, w_var, second, w_sq)
        ctx.conv = (stride, padding, b_loc is not None, b_var is not None)  # type: ignore[attr-defined]  # ctx attribute
        return out_mean, out_var

    @staticmethod
    @once_differentiable
    def backward(ctx: FunctionCtx, g_mean: Tensor, g_var: Tensor) -> tuple[Tensor | None, ...]:
        mean, var, w_loc, w_var, second, w_sq = ctx.saved_tensors  # type: ignore[attr-defined]  # FunctionCtx declares no saved_tensors
        need = ctx.needs_input_grad  # type: ignore[attr-defined]  # FunctionCtx declares no needs_input_grad
        stride, padding, has_b_loc, has_b_var = ctx.conv  # type: ignore[attr-defined]  # set in forward
        g_mean, g_var = g_mean.contiguous(), g_var.contiguous()

        def conv_t(grad: Tensor, x: Tensor, w: Tensor, mask: list[bool]) -> tuple[Any, ...]:
            # the input, kernel and bias gradients of conv(x, w) in one call, as mask asks
            if not any(mask):
                return None, None, None
            bias = [w.shape[0]] if mask[2] else None
            return torch.ops.aten.convolution_backward(  # type: ignore[no-any-return]  # aten op
                grad, x, w, bias, stride, padding, (1, 1), False, (0, 0), 1, mask
            )

        in_grad = need[0] or need[1]
        d_x_m, d_w_m, d_b_loc = conv_t(g_mean, mean, w_loc, [need[0], need[2], need[4]])
        d_second, d_w_var, d_b_var = conv_t(g_var, second, w_var, [in_grad, need[3], need[5]])
        d_x_v, d_w_sq, _ = conv_t(g_var, var, w_sq, [need[1], need[2], False])
        d_mean = torch.addcmul(d_x_m, mean, d_second, value=2) if need[0] else None
        d_var = d_second + d_x_v if need[1] else None
        d_w_loc = torch.addcmul(d_w_m, w_loc, d_w_sq, value=2) if need[2] else None
        return (
            d_mean,
            d_var,
            d_w_loc,
            d_w_var if need[3] else None,
            d_b_loc if need[4] and has_b_loc else None,
            d_b_var if need[5] and has_b_var else None,
            None,
            None,
        )


def conv2d_sample(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    stride: _Size = 1,
    padding: _Size = 0,
) -> Tensor:
    r"""Convolve sample ``s`` of ``x [S, B, C_in, H, W]`` with its own kernel ``weight[s]``.

    One grouped convolution: the samples become ``S`` groups of channels, so no Python loop.

    Args:
        x: inputs, one batch per weight sample.
        weight: kernels ``[S, C_out, C_in, kH, kW]``.
        bias: biases ``[S, C_out]`` or ``None``.
        stride: convolution stride.
        padding: zero padding on each side.

    Returns:
        ``[S, B, C_out, H', W']``.
    """
    s, b, c, h, w = x.shape
    c_out = weight.shape[1]
    grouped = x.transpose(0, 1).reshape(b, s * c, h, w)
    kernel = weight.reshape(s * c_out, *weight.shape[2:])
    flat_bias = None if bias is None else bias.reshape(s * c_out)
    out = F.conv2d(grouped, kernel, flat_bias, stride=stride, padding=padding, groups=s)
    return out.reshape(b, s, c_out, *out.shape[-2:]).transpose(0, 1)
