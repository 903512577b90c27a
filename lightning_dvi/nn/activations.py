"""Elementwise activations of a Gaussian: ReLU, Heaviside, LeakyReLU, GELU, SiLU, Tanh, Sigmoid."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian, Mode
from ..moments import smooth as S
from .base import BayesModule, Moments
from .registry import register_activation

__all__ = ["GELU", "Heaviside", "LeakyReLU", "ReLU", "SiLU", "Sigmoid", "Tanh"]

_Pair = tuple[Tensor, Tensor]
_A = TypeVar("_A", bound="_Activation")


class _Activation(BayesModule):
    image_output = None  # elementwise: images stay images
    _full: Callable[[Tensor, Tensor], _Pair]
    _diag: Callable[[Tensor, Tensor], _Pair]
    _slope: Callable[[Tensor, Tensor], Tensor]

    def elementwise(self, x: Tensor) -> Tensor:  # pragma: no cover - abstract
        """The activation of a tensor (what the sampling modes run)."""
        raise NotImplementedError

    @overload
    def apply(self, fn: Tensor) -> Tensor: ...

    @overload
    def apply(self: _A, fn: Callable[[nn.Module], None]) -> _A: ...

    def apply(self: _A, fn: Tensor | Callable[[nn.Module], None]) -> Tensor | _A:
        """On a tensor, the activation of it (:meth:`elementwise`); else ``nn.Module.apply``.

        ``nn.Module.apply(fn)`` walks the children of a container and calls theirs, so an
        activation must keep that meaning for ``net.apply(init_fn)`` to work on a network.
        """
        if isinstance(fn, Tensor):
            return self.elementwise(fn)
        return super().apply(fn)

    def propagate(self, x: Moments, mode: Mode) -> Moments:
        if not isinstance(x, Gaussian):
            return self.elementwise(x)
        return M.activation_moments(x, type(self)._full, type(self)._diag, mode=mode)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Mode) -> Tensor:
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

    def elementwise(self, x: Tensor) -> Tensor:
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

    def elementwise(self, x: Tensor) -> Tensor:
        """Step function of a tensor."""
        return (x > 0).to(x.dtype)


class _ParamActivation(_Activation):
    """An activation whose moment functions depend on the instance (slope, nodes, variant)."""

    def _moments_full(self, mean: Tensor, cov: Tensor) -> _Pair:  # pragma: no cover - abstract
        raise NotImplementedError

    def _moments_diag(self, mean: Tensor, var: Tensor) -> _Pair:  # pragma: no cover - abstract
        raise NotImplementedError

    def _moments_slope(self, mean: Tensor, var: Tensor) -> Tensor:  # pragma: no cover
        raise NotImplementedError

    def propagate(self, x: Moments, mode: Mode) -> Moments:
        """Tensor in, tensor out; Gaussian in, the Gaussian of the output (same storage)."""
        if not isinstance(x, Gaussian):
            return self.elementwise(x)
        return M.activation_moments(x, self._moments_full, self._moments_diag, mode=mode)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Mode) -> Tensor:
        """Stein's lemma: ``Cov(r, f(a)) = Cov(r, a) diag(E[f'(a)])``."""
        return M.cross_through_activation(cross, self._moments_slope(x.mean, x.var))


def _check_nodes(num_nodes: int) -> int:
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 2:
        raise ValueError(f"num_nodes must be an int >= 2, got {num_nodes!r}")
    return num_nodes


def _leaky_from_call(negative_slope: float = 0.01, inplace: bool = False) -> LeakyReLU:
    return LeakyReLU(negative_slope)


@register_activation(
    "leaky_relu",
    torch_modules=(nn.LeakyReLU,),
    torch_functions=(F.leaky_relu,),
    # the registry calls from_module only with instances of torch_modules
    from_module=lambda m: LeakyReLU(cast(nn.LeakyReLU, m).negative_slope),
    from_call=_leaky_from_call,
)
class LeakyReLU(_ParamActivation):
    r"""Leaky ReLU :math:`h = \alpha a + (1-\alpha)\max(0, a)` (``negative_slope`` :math:`\alpha`).

    Exact mean and variance; off-diagonal covariance through the ReLU form
    (:func:`lightning_dvi.moments.smooth.leaky_relu_full`).

    Args:
        negative_slope: :math:`\alpha`, the slope for :math:`a < 0` (any finite number).

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = LeakyReLU(0.1)(Gaussian(torch.zeros(1, 1), var=torch.ones(1, 1)), mode="diag")
        >>> round(out.mean.item(), 4)  # 0.9 / sqrt(2 pi)
        0.359
    """

    def __init__(self, negative_slope: float = 0.01) -> None:
        super().__init__()
        value = float(negative_slope)
        if not torch.isfinite(torch.tensor(value)):
            raise ValueError(f"negative_slope must be finite, got {negative_slope!r}")
        self.negative_slope = value

    def _moments_full(self, mean: Tensor, cov: Tensor) -> _Pair:
        return S.leaky_relu_full(mean, cov, self.negative_slope)

    def _moments_diag(self, mean: Tensor, var: Tensor) -> _Pair:
        return S.leaky_relu_diag(mean, var, self.negative_slope)

    def _moments_slope(self, mean: Tensor, var: Tensor) -> Tensor:
        return S.leaky_relu_slope(mean, var, self.negative_slope)

    def elementwise(self, x: Tensor) -> Tensor:
        """Leaky ReLU of a tensor."""
        return F.leaky_relu(x, self.negative_slope)

    def extra_repr(self) -> str:
        """The negative slope."""
        return f"negative_slope={self.negative_slope}"


class _QuadratureActivation(_ParamActivation):
    _kind: str

    def __init__(self, num_nodes: int = S.DEFAULT_NODES) -> None:
        super().__init__()
        self.num_nodes = _check_nodes(num_nodes)
        S.quadrature_rule(self.num_nodes)  # build (and cache) the rule now, not while tracing

    def _moments_full(self, mean: Tensor, cov: Tensor) -> _Pair:
        full: Callable[[Tensor, Tensor, int], _Pair] = getattr(S, f"{self._kind}_full")
        return full(mean, cov, self.num_nodes)

    def _moments_diag(self, mean: Tensor, var: Tensor) -> _Pair:
        diag: Callable[[Tensor, Tensor, int], _Pair] = getattr(S, f"{self._kind}_diag")
        return diag(mean, var, self.num_nodes)

    def _moments_slope(self, mean: Tensor, var: Tensor) -> Tensor:
        slope: Callable[[Tensor, Tensor, int], Tensor] = getattr(S, f"{self._kind}_slope")
        return slope(mean, var, self.num_nodes)

    def extra_repr(self) -> str:
        """The quadrature size."""
        return f"num_nodes={self.num_nodes}"


_GELU_VARIANTS = ("none", "tanh")


def _gelu_from_call(approximate: str = "none") -> GELU:
    return GELU(approximate)


@register_activation(
    "gelu",
    torch_modules=(nn.GELU,),
    torch_functions=(F.gelu,),
    from_module=lambda m: GELU(cast(nn.GELU, m).approximate),
    from_call=_gelu_from_call,
)
class GELU(_QuadratureActivation):
    r"""GELU :math:`h = a\Phi(a)`; on a Gaussian, returns the Gaussian of :math:`h`.

    Exact mean and variance in closed form (:func:`lightning_dvi.moments.smooth.gelu_diag`);
    off-diagonal covariance by the three-term Mehler series with exact diagonal. With
    ``approximate="tanh"`` (torch's tanh approximation) the moments are computed by
    Gauss–Hermite quadrature with ``num_nodes`` nodes (accurate while the pre-activation sd is
    below about 2; see ``docs/moments.md``).

    Args:
        approximate: ``"none"`` (exact GELU) or ``"tanh"``, as in ``torch.nn.GELU``.
        num_nodes: quadrature nodes for ``approximate="tanh"``.

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = GELU()(Gaussian(torch.zeros(1, 1), var=torch.ones(1, 1)), mode="diag")
        >>> round(out.mean.item(), 4)  # E[a Phi(a)] = 1 / (2 sqrt(pi))
        0.2821
    """

    def __init__(self, approximate: str = "none", num_nodes: int = S.DEFAULT_NODES) -> None:
        if approximate not in _GELU_VARIANTS:
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        super().__init__(num_nodes)
        self.approximate = approximate
        self._kind = "gelu_tanh" if approximate == "tanh" else "gelu"

    def _moments_full(self, mean: Tensor, cov: Tensor) -> _Pair:
        if self.approximate == "none":
            return S.gelu_full(mean, cov)
        return super()._moments_full(mean, cov)

    def _moments_diag(self, mean: Tensor, var: Tensor) -> _Pair:
        if self.approximate == "none":
            return S.gelu_diag(mean, var)
        return super()._moments_diag(mean, var)

    def _moments_slope(self, mean: Tensor, var: Tensor) -> Tensor:
        if self.approximate == "none":
            return S.gelu_slope(mean, var)
        return super()._moments_slope(mean, var)

    def elementwise(self, x: Tensor) -> Tensor:
        """GELU of a tensor."""
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        """The variant (and the quadrature size where it is used)."""
        if self.approximate == "none":
            return ""
        return f"approximate={self.approximate!r}, num_nodes={self.num_nodes}"


def _inplace_only(name: str) -> Callable[..., BayesModule]:
    def build(inplace: bool = False) -> BayesModule:
        return _BY_NAME[name]()

    return build


@register_activation(
    "silu",
    torch_modules=(nn.SiLU,),
    torch_functions=(F.silu,),
    from_call=_inplace_only("silu"),
)
class SiLU(_QuadratureActivation):
    r"""SiLU (swish) :math:`h = a\,\sigma(a)`; on a Gaussian, returns the Gaussian of :math:`h`.

    Mean, variance and :math:`E[h']` by quadrature (Gauss–Hermite for sd :math:`\le 1`, the
    logistic grid above), accurate to ~1e-9 relative; off-diagonal covariance by the
    three-term Mehler series with exact diagonal (:mod:`lightning_dvi.moments.smooth`).

    Args:
        num_nodes: Gauss–Hermite nodes.
    """

    _kind = "silu"

    def elementwise(self, x: Tensor) -> Tensor:
        """SiLU of a tensor."""
        return F.silu(x)


@register_activation(
    "tanh",
    torch_modules=(nn.Tanh,),
    torch_functions=(torch.tanh, Tensor.tanh, F.tanh),
)
class Tanh(_QuadratureActivation):
    r"""Hyperbolic tangent :math:`h = \tanh a = 2\sigma(2a) - 1` of a Gaussian.

    Moments as for :class:`Sigmoid` (through the identity); off-diagonal by the Mehler series.

    Args:
        num_nodes: Gauss–Hermite nodes.
    """

    _kind = "tanh"

    def elementwise(self, x: Tensor) -> Tensor:
        """Tanh of a tensor."""
        return torch.tanh(x)


@register_activation(
    "sigmoid",
    torch_modules=(nn.Sigmoid,),
    torch_functions=(torch.sigmoid, Tensor.sigmoid, F.sigmoid),
)
class Sigmoid(_QuadratureActivation):
    r"""Logistic sigmoid :math:`h = \sigma(a) = 1/(1 + e^{-a})` of a Gaussian.

    Mean, variance and :math:`E[\sigma'(a)]` by quadrature (Gauss–Hermite for sd :math:`\le 1`,
    the logistic representation :math:`\sigma(x) = P(L < x)` above), accurate to ~1e-9
    relative, rather than the probit approximation :math:`\sigma(x)\approx\Phi(x\sqrt{\pi/8})`
    (off by up to 0.018); off-diagonal covariance by the three-term Mehler series.

    Args:
        num_nodes: Gauss–Hermite nodes.

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = Sigmoid()(Gaussian(torch.zeros(1, 1), var=torch.ones(1, 1)), mode="diag")
        >>> round(out.mean.item(), 4)
        0.5
    """

    _kind = "sigmoid"

    def elementwise(self, x: Tensor) -> Tensor:
        """Sigmoid of a tensor."""
        return torch.sigmoid(x)


_BY_NAME: dict[str, type[BayesModule]] = {"silu": SiLU}
