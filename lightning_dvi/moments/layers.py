r"""Layer moments as one interpreter: weight moments and input moments in, a Gaussian out.

These functions pick the closed form (:mod:`.linear`, :mod:`.activations`, :mod:`.residual`)
for the storage of the input and the mode, and are the only place that choice is made: the
declared modules of :mod:`lightning_dvi.nn` and the Pyro moment pass both call them.

Storage rule (shared by every front-end): in ``full`` mode a Gaussian whose covariance is
*exactly* diagonal (a layer fed a deterministic input, and the activation after it) travels in
diag storage, which skips the :math:`O(D^3)` work on zeros; ``diag`` mode drops covariances,
except those of a narrow linear layer's outputs (:data:`HEAD_WIDTH`: a network's head, whose
likelihood reads them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ..gaussian import Gaussian
from ..propagation import Mode, Propagation, propagation
from .conv import conv2d_deterministic, conv2d_diag
from .linear import linear_deterministic, linear_diag, linear_full, linear_full_from_diag
from .residual import residual_diag, residual_full

__all__ = [
    "HEAD_WIDTH",
    "activation_moments",
    "as_storage",
    "conv2d_moments",
    "linear_moments",
    "residual_moments",
    "skip_covariance",
]

#: In ``diag`` mode a linear layer of at most this many outputs fed a Gaussian keeps the exact
#: covariance of its outputs (and of its input, if that has one). The outputs share their
#: inputs, so they are correlated even when the inputs are independent, and a likelihood that
#: reads several outputs depends on it: a softmax's expected log-likelihood with the logit
#: covariances dropped sat above a Monte Carlo ELBO (1.3 % on a trained ``DVIClassifier``, 7 %
#: on a Pyro digits classifier). The next activation or wide layer drops it again; a narrow
#: hidden layer pays :math:`O(D_{out}^2)` per example for it.
HEAD_WIDTH = 16

_Pair = tuple[Tensor, Tensor]
_Size = int | tuple[int, int]


def linear_moments(
    x: Tensor | Gaussian,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None = None,
    b_var: Tensor | None = None,
    *,
    mode: Mode | Propagation,
) -> Gaussian:
    r"""The Gaussian of :math:`a = hW^\top + b` with :math:`W_{kj}\sim\mathcal N(M_{kj}, V_{kj})`.

    Args:
        x: a deterministic input ``[..., D_in]`` (the output units are then independent:
            diagonal covariance, exactly) or the input Gaussian.
        w_loc: weight means :math:`M` ``[D_out, D_in]``.
        w_var: weight variances :math:`V` ``[D_out, D_in]``.
        b_loc: bias means ``[D_out]`` or ``None``.
        b_var: bias variances ``[D_out]`` or ``None``.
        mode: ``"full"`` (DVI) or ``"diag"`` (dDVI; a layer of at most :data:`HEAD_WIDTH`
            outputs still returns their full covariance, :math:`M\Sigma_h M^\top` plus the
            diagonal terms, from a diag or full input).

    Returns:
        The output Gaussian (diag storage when its covariance is exactly diagonal, or in
        ``diag`` mode for a layer wider than :data:`HEAD_WIDTH`).
    """
    if not isinstance(x, Gaussian):
        mean, var = linear_deterministic(x, w_loc, w_var, b_loc, b_var)
        return Gaussian(mean, var=var, validate=False)
    diag = propagation(mode).diag
    if diag and w_loc.shape[-2] > HEAD_WIDTH:
        x = x.to_diag()
    if x.cov is not None:
        mean, cov = linear_full(x.mean, x.cov, w_loc, w_var, b_loc, b_var)
        return Gaussian(mean, cov=cov, validate=False)
    if not diag or w_loc.shape[-2] <= HEAD_WIDTH:
        mean, cov = linear_full_from_diag(x.mean, x.var, w_loc, w_var, b_loc, b_var)
        return Gaussian(mean, cov=cov, validate=False)
    mean, var = linear_diag(x.mean, x.var, w_loc, w_var, b_loc, b_var)
    return Gaussian(mean, var=var, validate=False)


def conv2d_moments(
    x: Tensor | Gaussian,
    w_loc: Tensor,
    w_var: Tensor,
    b_loc: Tensor | None = None,
    b_var: Tensor | None = None,
    *,
    stride: _Size = 1,
    padding: _Size = 0,
) -> Gaussian:
    r"""The per-pixel Gaussian of :math:`a = \operatorname{conv}(h, W) + b` (factorised weights).

    :func:`.conv2d_deterministic` for a deterministic image (exact), :func:`.conv2d_diag` for
    independent Gaussian pixels (exact marginals; the covariances between output pixels are
    dropped, so the output is a diag Gaussian in every mode).

    Args:
        x: a deterministic image batch ``[B, C_in, H, W]`` or a diag Gaussian of that shape.
        w_loc: kernel means ``[C_out, C_in, kH, kW]``.
        w_var: kernel variances, same shape.
        b_loc: bias means ``[C_out]`` or ``None``.
        b_var: bias variances ``[C_out]`` or ``None``.
        stride: convolution stride.
        padding: zero padding on each side.

    Raises:
        ValueError: for a full-covariance input (image stages carry per-pixel moments).
    """
    conv = {"stride": stride, "padding": padding}
    if not isinstance(x, Gaussian):
        mean, var = conv2d_deterministic(x, w_loc, w_var, b_loc, b_var, **conv)
    elif x.is_full:
        raise ValueError("conv2d_moments needs per-pixel (diag) moments, got a full covariance")
    else:
        mean, var = conv2d_diag(x.mean, x.var, w_loc, w_var, b_loc, b_var, **conv)
    return Gaussian(mean, var=var, validate=False)


def activation_moments(
    x: Gaussian,
    full: Callable[[Tensor, Tensor], _Pair],
    diag: Callable[[Tensor, Tensor], _Pair],
    *,
    mode: Mode | Propagation,
) -> Gaussian:
    r"""The Gaussian of :math:`h = f(a)` elementwise, from ``f``'s two closed forms.

    Args:
        x: the input Gaussian.
        full: ``(mean, cov) -> (mean, cov)`` of ``f`` (e.g. :func:`.relu_full`).
        diag: ``(mean, var) -> (mean, var)`` of ``f``, exact marginals (e.g. :func:`.relu_diag`).
        mode: ``"full"`` or ``"diag"``.

    A diag input in ``full`` mode has :math:`\rho = 0` exactly, so its output is diagonal too.
    """
    if propagation(mode).diag:
        x = x.to_diag()
    if x.cov is not None:
        mean, cov = full(x.mean, x.cov)
        return Gaussian(mean, cov=cov, validate=False)
    mean, var = diag(x.mean, x.var)
    return Gaussian(mean, var=var, validate=False)


def as_storage(g: Gaussian, mode: Mode | Propagation) -> Gaussian:
    """``g`` in the storage ``mode`` asks for: full covariance in ``full``, variances otherwise.

    Where a block needs its input's storage fixed (a skip connection, whose cross-covariance
    starts from it), it asks here rather than testing ``cov is None`` itself.
    """
    return g.to_full() if propagation(mode).full else g.to_diag()


def skip_covariance(x: Gaussian) -> Tensor:
    r""":math:`\operatorname{Cov}(a', a')` ``[..., D, D]``, the cross-covariance a skip starts from."""
    return x.cov if x.cov is not None else torch.diag_embed(x.var)


def residual_moments(x: Gaussian, delta: Gaussian, cross: Tensor) -> Gaussian:
    r"""The Gaussian of :math:`a' + \delta` given :math:`X = \operatorname{Cov}(a', \delta)`.

    Full storage of ``x`` gives :math:`\Sigma' + \Sigma_\delta + X + X^\top`; diag storage keeps
    only the diagonal (:func:`.residual_diag`).

    Raises:
        ValueError: when the branch changed the width.
    """
    if delta.mean.shape[-1] != x.mean.shape[-1]:
        raise ValueError(
            f"Residual branch maps width {x.mean.shape[-1]} to {delta.mean.shape[-1]}; "
            "a skip connection needs equal widths"
        )
    if x.cov is not None:
        delta_cov = skip_covariance(delta)
        mean, cov = residual_full(x.mean, x.cov, delta.mean, delta_cov, cross)
        return Gaussian(mean, cov=cov, validate=False)
    mean, var = residual_diag(x.mean, x.var, delta.mean, delta.var, cross)
    return Gaussian(mean, var=var, validate=False)
