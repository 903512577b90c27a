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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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
    """
    out_var = _affine(torch.addcmul(var, mean, mean), w_var, b_var)
    out_var = out_var + _affine(var, w_loc * w_loc)
    return _affine(mean, w_loc, b_loc), out_var


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
    out_cov = symmetrize((w_loc * var.unsqueeze(-2)) @ w_loc.transpose(-1, -2))
    return _affine(mean, w_loc, b_loc), _plus_diagonal(out_cov, diag)
