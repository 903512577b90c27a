"""Elementwise activations of a Gaussian: ReLU, Heaviside, LeakyReLU, ELU, GELU, SiLU, Softplus...

Also Tanh and Sigmoid; each registers itself with :func:`~.registry.register_activation`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar, cast, overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from ..moments import elu as E
from ..moments import smooth as S
from ..propagation import Propagation
from .base import BayesModule, Moments
from .registry import register_activation

__all__ = ["ELU", "GELU", "Heaviside", "LeakyReLU", "ReLU", "SiLU", "Sigmoid", "Softplus", "Tanh"]

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

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        if not isinstance(x, Gaussian):
            return self.elementwise(x)
        return M.activation_moments(x, type(self)._full, type(self)._diag, mode=mode)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
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

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Tensor in, tensor out; Gaussian in, the Gaussian of the output (same storage)."""
        if not isinstance(x, Gaussian):
            return self.elementwise(x)
        return M.activation_moments(x, self._moments_full, self._moments_diag, mode=mode)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """Stein's lemma: ``Cov(r, f(a)) = Cov(r, a) diag(E[f'(a)])``."""
        return M.cross_through_activation(cross, self._moments_slope(x.mean, x.var))


def _check_nodes(num_nodes: int | None) -> int | None:
    if num_nodes is None:
        return None
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 2:
        raise ValueError(f"num_nodes must be None or an int >= 2, got {num_nodes!r}")
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
    """An activation whose moments come from the quadrature engine of :mod:`.moments.smooth`.

    ``num_nodes`` overrides the Gauss–Hermite node counts the activation's kernel picks by the
    input's spread (``None``: the kernel's, measured to 1e-5 relative; docs/moments.md).
    """

    _kind: str

    def __init__(self, num_nodes: int | None = None) -> None:
        super().__init__()
        self.num_nodes = _check_nodes(num_nodes)
        if self.num_nodes is not None:
            S.quadrature_rule(self.num_nodes)  # build (and cache) the rule now, not while tracing

    def _moments_full(self, mean: Tensor, cov: Tensor) -> _Pair:
        full: Callable[[Tensor, Tensor, int | None], _Pair] = getattr(S, f"{self._kind}_full")
        return full(mean, cov, self.num_nodes)

    def _moments_diag(self, mean: Tensor, var: Tensor) -> _Pair:
        diag: Callable[[Tensor, Tensor, int | None], _Pair] = getattr(S, f"{self._kind}_diag")
        return diag(mean, var, self.num_nodes)

    def _moments_slope(self, mean: Tensor, var: Tensor) -> Tensor:
        slope: Callable[[Tensor, Tensor, int | None], Tensor] = getattr(S, f"{self._kind}_slope")
        return slope(mean, var, self.num_nodes)

    def extra_repr(self) -> str:
        """The quadrature size, where set."""
        return "" if self.num_nodes is None else f"num_nodes={self.num_nodes}"


_GELU_VARIANTS = ("none", "tanh")


def check_gelu_rule(rule: str, approximate: str = "none") -> S.GeluRule:
    """``rule`` if it is one of :data:`~lightning_dvi.moments.smooth.GELU_RULES` for this variant.

    Raises:
        ValueError: for an unknown rule, or ``"closed"``/``"slope"`` with
            ``approximate="tanh"`` (the tanh form has no closed-form moments; it keeps the
            quadrature).
    """
    if rule not in S.GELU_RULES:
        raise ValueError(f"GELU rule must be one of {S.GELU_RULES}, got {rule!r}")
    if rule in ("closed", "slope") and approximate != "none":
        raise ValueError(f"GELU rule={rule!r} is for the exact GELU (approximate='none') only")
    return cast(S.GeluRule, rule)


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

    Mean, variance and :math:`E[h']` by the quadrature engine of
    :mod:`lightning_dvi.moments.smooth` (Gauss–Hermite for small spreads, the asymptote plus a
    Gauss–Laguerre rule for large ones; within 1e-4 relative, ``docs/moments.md``), for
    ``approximate="none"`` (exact GELU) and ``"tanh"`` (torch's tanh approximation) alike;
    off-diagonal covariance by the three-term Mehler series with exact diagonal.

    ``rule="closed"`` (exact GELU only) replaces the quadrature by the closed form of
    :func:`lightning_dvi.moments.smooth.gelu_closed_diag` (the mean exactly, the variance
    through one 10-node Gauss–Legendre integral for the bivariate normal CDF, relative error
    below 1e-7 in float64 for :math:`|m| \le 12`) and of
    :func:`~lightning_dvi.moments.smooth.gelu_closed_slope` (:math:`E[h']`, exact), at a
    fraction of the quadrature's cost (``docs/transformer_benchmark.md``); the Mehler
    coefficients of full mode are closed forms too. ``rule="slope"`` (exact GELU only) keeps
    that exact mean and :math:`E[h']` but only the variance's term linear in the input
    variance, :math:`E[h']^2 v` (:func:`lightning_dvi.moments.smooth.gelu_slope_diag`: a lower
    bound, short by :math:`O(v^2)`), a few elementwise operations, for small input variances.

    Args:
        approximate: ``"none"`` (exact GELU) or ``"tanh"``, as in ``torch.nn.GELU``.
        num_nodes: Gauss–Hermite nodes of the quadrature rule (default: chosen by the input's
            spread).
        rule: ``"quadrature"`` (the engine, the default), ``"closed"`` or ``"slope"``
            (:data:`lightning_dvi.moments.smooth.GELU_RULES`; ``approximate="none"`` only).

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = GELU()(Gaussian(torch.zeros(1, 1), var=torch.ones(1, 1)), mode="diag")
        >>> round(out.mean.item(), 4)  # E[a Phi(a)] = 1 / (2 sqrt(pi))
        0.2821
    """

    def __init__(
        self,
        approximate: str = "none",
        num_nodes: int | None = None,
        rule: S.GeluRule = "quadrature",
    ) -> None:
        if approximate not in _GELU_VARIANTS:
            raise ValueError(f"GELU approximate must be 'none' or 'tanh', got {approximate!r}")
        super().__init__(num_nodes)
        self.approximate = approximate
        self._kind = "gelu_tanh" if approximate == "tanh" else "gelu"
        self.rule: S.GeluRule = check_gelu_rule(rule, approximate)

    def _moments_full(self, mean: Tensor, cov: Tensor) -> _Pair:
        if self.rule == "slope":
            return S.gelu_slope_full(mean, cov)
        if self.rule == "closed":
            return S.gelu_closed_full(mean, cov)
        return super()._moments_full(mean, cov)

    def _moments_diag(self, mean: Tensor, var: Tensor) -> _Pair:
        if self.rule == "slope":
            return S.gelu_slope_diag(mean, var)
        if self.rule == "closed":
            return S.gelu_closed_diag(mean, var)
        return super()._moments_diag(mean, var)

    def _moments_slope(self, mean: Tensor, var: Tensor) -> Tensor:
        if self.rule in ("closed", "slope"):
            return S.gelu_closed_slope(mean, var)
        return super()._moments_slope(mean, var)

    def elementwise(self, x: Tensor) -> Tensor:
        """GELU of a tensor."""
        return F.gelu(x, approximate=self.approximate)

    def extra_repr(self) -> str:
        """The variant and the quadrature size, where not the defaults."""
        parts = [] if self.approximate == "none" else [f"approximate={self.approximate!r}"]
        nodes = super().extra_repr()
        rule = [] if self.rule == "quadrature" else [f"rule={self.rule!r}"]
        return ", ".join(parts + ([nodes] if nodes else []) + rule)


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

    Mean, variance and :math:`E[h']` by the quadrature engine (Gauss–Hermite for small
    spreads, the asymptote :math:`a` plus a Gauss–Laguerre rule for large ones), within 1e-4
    relative; off-diagonal covariance by the three-term Mehler series with exact diagonal
    (:mod:`lightning_dvi.moments.smooth`).

    Args:
        num_nodes: Gauss–Hermite nodes (default: chosen by the input's spread).
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
        num_nodes: Gauss–Hermite nodes (default: chosen by the input's spread).
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

    Mean, variance and :math:`E[\sigma'(a)]` by quadrature (Gauss–Hermite for small spreads,
    the asymptote 1 plus a Gauss–Laguerre rule on :math:`\sigma(-|x|)` for large ones), within
    1e-4 relative, rather than the probit approximation
    :math:`\sigma(x)\approx\Phi(x\sqrt{\pi/8})` (off by up to 0.018); off-diagonal covariance
    by the three-term Mehler series.

    Args:
        num_nodes: Gauss–Hermite nodes (default: chosen by the input's spread).

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


def _elu_from_call(alpha: float = 1.0, inplace: bool = False) -> ELU:
    return ELU(alpha)


@register_activation(
    "elu",
    torch_modules=(nn.ELU,),
    torch_functions=(F.elu,),
    from_module=lambda m: ELU(cast(nn.ELU, m).alpha),
    from_call=_elu_from_call,
)
class ELU(_ParamActivation):
    r"""ELU :math:`h = a` for :math:`a > 0`, :math:`\alpha(e^a - 1)` otherwise, of a Gaussian.

    Exact mean, variance and :math:`E[h']` in closed form (:mod:`lightning_dvi.moments.elu`);
    off-diagonal covariance by the three-term Mehler series with exact diagonal.

    Args:
        alpha: :math:`\alpha`, as in ``torch.nn.ELU`` (any finite number).

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = ELU()(Gaussian(torch.zeros(1, 1), var=torch.ones(1, 1)), mode="diag")
        >>> round(out.mean.item(), 4), round(out.var.item(), 4)  # E ELU(x), x ~ N(0, 1)
        (0.1605, 0.6192)
        >>> out = ELU()(Gaussian(torch.full((1, 1), -1.0), var=torch.zeros(1, 1)), mode="diag")
        >>> round(out.mean.item(), 4), round(out.var.item(), 6)  # no variance: ELU(-1) = e^-1 - 1
        (-0.6321, 0.0)
    """

    def __init__(self, alpha: float = 1.0) -> None:
        super().__init__()
        value = float(alpha)
        if not torch.isfinite(torch.tensor(value)):
            raise ValueError(f"ELU alpha must be finite, got {alpha!r}")
        self.alpha = value

    def _moments_full(self, mean: Tensor, cov: Tensor) -> _Pair:
        return E.elu_full(mean, cov, self.alpha)

    def _moments_diag(self, mean: Tensor, var: Tensor) -> _Pair:
        return E.elu_diag(mean, var, self.alpha)

    def _moments_slope(self, mean: Tensor, var: Tensor) -> Tensor:
        return E.elu_slope(mean, var, self.alpha)

    def elementwise(self, x: Tensor) -> Tensor:
        """ELU of a tensor."""
        return F.elu(x, self.alpha)

    def extra_repr(self) -> str:
        """The saturation value."""
        return f"alpha={self.alpha}"


def _softplus_from_call(beta: float = 1.0, threshold: float = 20.0) -> Softplus:
    return Softplus(beta, threshold)


@register_activation(
    "softplus",
    torch_modules=(nn.Softplus,),
    torch_functions=(F.softplus,),
    from_module=lambda m: Softplus(cast(nn.Softplus, m).beta, cast(nn.Softplus, m).threshold),
    from_call=_softplus_from_call,
)
class Softplus(_QuadratureActivation):
    r"""Softplus :math:`h = \log(1 + e^{\beta a})/\beta` of a Gaussian.

    Mean, variance and :math:`E[h'] = E[\sigma(\beta a)]` by the quadrature engine
    (Gauss–Hermite for small spreads, the asymptote :math:`a` plus a Gauss–Laguerre rule on
    :math:`\log(1 + e^{-|x|})` for large ones), within 1e-5 relative; off-diagonal covariance by
    the three-term Mehler series.

    Args:
        beta: :math:`\beta > 0`, as in ``torch.nn.Softplus``.
        threshold: as in ``torch.nn.Softplus``: above ``beta * a > threshold`` torch returns
            :math:`a` (a difference below :math:`e^{-\mathrm{threshold}}/\beta`); kept for the
            sampling modes, the moments are those of the exact softplus.
        num_nodes: Gauss–Hermite nodes (default: chosen by the input's spread).

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> out = Softplus()(Gaussian(torch.zeros(1, 1), var=torch.zeros(1, 1)), mode="diag")
        >>> round(out.mean.item(), 4)  # log 2
        0.6931
    """

    _kind = "softplus"

    def __init__(
        self, beta: float = 1.0, threshold: float = 20.0, num_nodes: int | None = None
    ) -> None:
        super().__init__(num_nodes)
        self.beta, self.threshold = float(beta), float(threshold)
        if not (math.isfinite(self.beta) and self.beta > 0):
            raise ValueError(f"Softplus beta must be a positive finite number, got {beta!r}")

    def _moments_full(self, mean: Tensor, cov: Tensor) -> _Pair:
        return S.softplus_full(mean, cov, self.beta, self.num_nodes)

    def _moments_diag(self, mean: Tensor, var: Tensor) -> _Pair:
        return S.softplus_diag(mean, var, self.beta, self.num_nodes)

    def _moments_slope(self, mean: Tensor, var: Tensor) -> Tensor:
        return S.softplus_slope(mean, var, self.beta, self.num_nodes)

    def elementwise(self, x: Tensor) -> Tensor:
        """Softplus of a tensor (torch's, with its threshold)."""
        return F.softplus(x, self.beta, self.threshold)

    def extra_repr(self) -> str:
        """Beta and threshold (and the quadrature size where set)."""
        nodes = super().extra_repr()
        return f"beta={self.beta}, threshold={self.threshold}" + (f", {nodes}" if nodes else "")


_BY_NAME: dict[str, type[BayesModule]] = {"silu": SiLU}
