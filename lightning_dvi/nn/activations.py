"""Elementwise activations of a Gaussian: ReLU and Heaviside."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from .base import BayesModule, Moments
from .registry import register_activation

__all__ = ["Heaviside", "ReLU"]

_Pair = tuple[Tensor, Tensor]


class _Activation(BayesModule):
    image_output = None  # elementwise: images stay images
    _full: Callable[[Tensor, Tensor], _Pair]
    _diag: Callable[[Tensor, Tensor], _Pair]
    _slope: Callable[[Tensor, Tensor], Tensor]

    def apply(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def propagate(self, x: Moments, mode: str) -> Moments:
        if not isinstance(x, Gaussian):
            return self.apply(x)
        if mode == "diag":
            x = x.to_diag()
        # a diag input in full mode has rho = 0 exactly, so the output is exactly diagonal too
        if x.is_full:
            mean, cov = type(self)._full(x.mean, x.cov)
            return Gaussian(mean, cov=cov, validate=False)
        mean, var = type(self)._diag(x.mean, x.var)
        return Gaussian(mean, var=var, validate=False)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: str) -> Tensor:
        return M.cross_through_activation(cross, type(self)._slope(x.mean, x.var))


@register_activation(
    "relu", torch_modules=(nn.ReLU,), torch_functions=(torch.relu, F.relu, Tensor.relu)
)
class ReLU(_Activation):
    r"""ReLU :math:`h = \max(0, a)`; on a Gaussian, returns the Gaussian of :math:`h`.

    Exact mean and variance; off-diagonal covariance by the corrected DVI approximation
    (:func:`lightning_dvi.moments.relu_full`).

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = ReLU()(Gaussian(torch.zeros(1, 2), var=torch.ones(1, 2)), mode="diag")
        >>> round(out.mean[0, 0].item(), 4)  # E[max(0, N(0,1))] = 1/sqrt(2 pi)
        0.3989
    """

    _full = staticmethod(M.relu_full)
    _diag = staticmethod(M.relu_diag)
    _slope = staticmethod(M.relu_slope)

    def apply(self, x: Tensor) -> Tensor:
        """ReLU of a tensor."""
        return torch.relu(x)


@register_activation("heaviside")
class Heaviside(_Activation):
    r"""Heaviside step :math:`h = \mathbb 1[a > 0]`; on a Gaussian, returns the Gaussian of :math:`h`.

    Exact mean :math:`\Phi(\mu)` and variance :math:`\Phi(\mu)\Phi(-\mu)`; off-diagonal
    covariance by :func:`lightning_dvi.moments.heaviside_full`. On tensors (sampling modes) it is
    the hard step, which has zero gradient: train Heaviside nets in ``full``/``diag`` mode.
    """

    _full = staticmethod(M.heaviside_full)
    _diag = staticmethod(M.heaviside_diag)
    _slope = staticmethod(M.heaviside_slope)

    def apply(self, x: Tensor) -> Tensor:
        """Step function of a tensor."""
        return (x > 0).to(x.dtype)
