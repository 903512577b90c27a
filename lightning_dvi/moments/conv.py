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

import torch
import torch.nn.functional as F
from torch import Tensor

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

    Returns:
        ``(mean, var)``, each ``[B, C_out, H', W']``.
    """
    out_mean = F.conv2d(mean, w_loc, b_loc, stride=stride, padding=padding)
    second = torch.addcmul(var, mean, mean)
    out_var = F.conv2d(second, w_var, b_var, stride=stride, padding=padding)
    out_var = out_var + F.conv2d(var, w_loc * w_loc, None, stride=stride, padding=padding)
    return out_mean, out_var


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
