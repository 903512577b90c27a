r"""Layer and group normalization modules: ``LayerNorm``, ``GroupNorm``.

Thin modules over :mod:`lightning_dvi.moments.layer_norm`: the moments of
:math:`(a - \bar a)/\sqrt{\operatorname{var}(a) + \epsilon}` over the normalized elements (the
exact route by one-dimensional quadrature, or the tight linearized form where the input
variance is negligible), then the elementwise affine :math:`\gamma, \beta` exactly
(:func:`lightning_dvi.moments.affine_diag`). :math:`\gamma, \beta` are point parameters, as in
:mod:`lightning_dvi.nn.normalization`.

Storage: a flat ``[B, D]`` Gaussian normalized over its last dimension keeps (``full`` mode)
or gets a full covariance (:func:`~lightning_dvi.moments.layer_norm.normalize_full`, which
costs an eigendecomposition per example); otherwise (images, ``diag`` mode, a normalized shape
of several dimensions) the output is the per-unit marginals
(:func:`~lightning_dvi.moments.layer_norm.normalize_diag`, :math:`O(D)` per quadrature node).
Tensors (deterministic inputs, the Monte Carlo modes) run torch's ``layer_norm``/``group_norm``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..gaussian import Gaussian
from ..moments import layer_norm as L
from ..moments import normalization as N
from ..propagation import Propagation
from .base import BayesModule, Moments
from .registry import ConversionOptions, register_layer

__all__ = ["GroupNorm", "LayerNorm"]


def _user_shape(x: Moments, mode: Propagation) -> tuple[int, ...]:
    shape = tuple(x.shape)
    return shape[1:] if mode.samples and isinstance(x, Tensor) else shape


def _check_dtype(name: str, x: Moments, param: Tensor | None) -> None:
    if param is not None and x.dtype != param.dtype:
        raise ValueError(
            f"{name} parameters are {param.dtype} but the input is {x.dtype}; convert one of "
            "them (e.g. net.double() or x.float())"
        )


def _copy_affine(layer: nn.Module, module: nn.Module) -> None:
    with torch.no_grad():
        for name in ("weight", "bias"):
            theirs, ours = getattr(module, name, None), getattr(layer, name, None)
            if theirs is not None and ours is not None:
                ours.copy_(theirs)


def _from_torch_layer_norm(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.LayerNorm)  # the registry's torch_modules
    layer = LayerNorm(
        module.normalized_shape,
        module.eps,
        module.elementwise_affine,
        bias=module.bias is not None,
    )
    if module.weight is not None:
        layer = layer.to(device=module.weight.device, dtype=module.weight.dtype)
    _copy_affine(layer, module)
    return layer


def _layer_norm_from_call(
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> BayesModule:
    """``F.layer_norm(x, ...)`` in a Pyro model: a LayerNorm holding the caller's own tensors."""
    layer = LayerNorm(normalized_shape, eps, elementwise_affine=False)
    layer.weight, layer.bias = weight, bias  # the caller's tensors: gradients reach them
    return layer


@register_layer(
    "layer_norm",
    kind="normalization",
    torch_modules=(nn.LayerNorm,),
    torch_functions=(F.layer_norm,),
    convert=_from_torch_layer_norm,
    from_call=_layer_norm_from_call,
)
class LayerNorm(BayesModule):
    r"""Layer normalization over the trailing ``normalized_shape`` dimensions, on Gaussians.

    :math:`y = \gamma\circ(a - \bar a)/\sqrt{\operatorname{var}(a) + \epsilon} + \beta` (the
    biased variance over the normalized elements, as in torch). Moments: module docstring and
    :mod:`lightning_dvi.moments.layer_norm`; inside a :class:`~lightning_dvi.nn.Residual` the
    cross-covariance passes through :math:`E[\nabla y]` (Stein's lemma).

    Args:
        normalized_shape: the trailing shape normalized over (an int for the last dimension).
        eps: :math:`\epsilon`.
        elementwise_affine: learn :math:`\gamma` (and :math:`\beta`), point parameters.
        bias: learn :math:`\beta` (with ``elementwise_affine``).
        route: ``"auto"`` (the exact moments unless the input variance is negligible) or
            ``"first_order"`` (the linearization :math:`y \approx \hat m + J(a - \mu)` for
            every vector: :math:`O(D)` per token in diag mode, no quadrature, and its
            cross-covariance for a skip connection in :math:`O(D^2)`); see
            :mod:`lightning_dvi.moments.layer_norm`. The attribute can be set after
            construction.

    Examples:
        >>> from lightning_dvi import Gaussian
        >>> ln = LayerNorm(4)
        >>> out = ln(Gaussian(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), var=torch.zeros(1, 4)))
        >>> [round(v, 3) for v in out.mean[0].tolist()]
        [-1.342, -0.447, 0.447, 1.342]
    """

    image_output = None  # shape-preserving
    point_parameters = ("weight", "bias")

    def __init__(
        self,
        normalized_shape: int | Sequence[int],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        route: L.LayerNormRoute = "auto",
    ) -> None:
        super().__init__()
        if route not in L.ROUTES:
            raise ValueError(f"LayerNorm: route must be one of {L.ROUTES}, got {route!r}")
        self.route: L.LayerNormRoute = route
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
        self.normalized_shape = tuple(int(d) for d in shape)
        if not self.normalized_shape or min(self.normalized_shape) < 1:
            raise ValueError(
                f"LayerNorm: normalized_shape must be positive ints, got {normalized_shape!r}"
            )
        if not eps > 0:
            raise ValueError(f"LayerNorm: eps must be positive, got {eps!r}")
        self.eps = float(eps)
        self.elementwise_affine = elementwise_affine
        self.weight: Tensor | None = None
        self.bias: Tensor | None = None
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape))
            if bias:
                self.bias = nn.Parameter(torch.zeros(self.normalized_shape))

    def _check(self, x: Moments, mode: Propagation) -> tuple[int, ...]:
        user = _user_shape(x, mode)
        k = len(self.normalized_shape)
        if len(user) < k + 1 or user[-k:] != self.normalized_shape:
            raise ValueError(
                f"LayerNorm{self.normalized_shape} expects input of shape [B, ..., "
                f"{', '.join(map(str, self.normalized_shape))}], got shape {user}"
            )
        if isinstance(x, Gaussian) and x.is_full and (len(user) < 2 or k != 1):
            raise ValueError(
                f"LayerNorm: a full-covariance input must be [B, ..., D] normalized over D, got "
                f"shape {user} with normalized_shape {self.normalized_shape}"
            )
        _check_dtype("LayerNorm", x, self.weight)
        return user

    def _flat_affine(self) -> tuple[Tensor, Tensor]:
        d = math.prod(self.normalized_shape)
        ref = self.weight
        one = torch.ones(d) if ref is None else ref.reshape(-1)
        zero = torch.zeros_like(one) if self.bias is None else self.bias.reshape(-1)
        return one, zero

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Normalize a tensor (any mode) or a Gaussian (``full``/``diag``)."""
        user = self._check(x, mode)
        if isinstance(x, Tensor):
            return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        k = len(self.normalized_shape)
        if mode.full and (len(user) == 2 or x.is_full) and k == 1:
            g = x.to_full()
            mean, cov = L.normalize_full(g.mean, cast(Tensor, g.cov), self.eps, self.route)
            scale, shift = self._flat_affine()
            mean, cov = N.affine_full(mean, cov, scale.to(mean), shift.to(mean))
            return Gaussian(mean, cov=cov, validate=False)
        if self.route == "first_order" and k == 1:
            mean, var = L.layer_norm_first_order_diag(
                x.mean.reshape(user), x.var.reshape(user), self.eps, self.weight, self.bias
            )
            return Gaussian(mean, var=var, validate=False)
        flat = (*user[:-k], -1)
        mean, var = L.normalize_diag(
            x.mean.reshape(flat), x.var.reshape(flat), self.eps, self.route
        )
        mean, var = mean.reshape(user), var.reshape(user)
        if self.weight is not None:
            shift = self.bias if self.bias is not None else torch.zeros_like(self.weight)
            mean, var = N.affine_diag(mean, var, self.weight, shift)
        return Gaussian(mean, var=var, validate=False)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        r""":math:`\operatorname{Cov}(r, y) = \operatorname{Cov}(r, a)E[\nabla y]^\top\operatorname{diag}(\gamma)`."""
        self._check(x, mode)
        if len(self.normalized_shape) != 1:
            raise ValueError("LayerNorm inside a Residual block normalizes over one dimension")
        if x.cov is None:  # diag moments: no [D, D] covariance, no eigendecomposition
            out = L.normalize_cross_diag(cross, x.mean, x.var, self.eps, self.route)
        else:
            jac = L.normalize_jacobian(x.mean, x.cov, self.eps, self.route)
            out = cross @ jac.transpose(-1, -2)
        return out if self.weight is None else out * self.weight

    def extra_repr(self) -> str:
        """Options for ``repr``."""
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, bias={self.bias is not None}"
            + ("" if self.route == "auto" else f", route={self.route!r}")
        )


def _from_torch_group_norm(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.GroupNorm)
    layer = GroupNorm(module.num_groups, module.num_channels, module.eps, module.affine)
    if module.weight is not None:
        layer = layer.to(device=module.weight.device, dtype=module.weight.dtype)
    _copy_affine(layer, module)
    return layer


@register_layer(
    "group_norm",
    kind="normalization",
    torch_modules=(nn.GroupNorm,),
    convert=_from_torch_group_norm,
)
class GroupNorm(BayesModule):
    r"""Group normalization of ``[B, C, *]`` inputs: layer normalization over each group.

    The ``C`` channels split into ``num_groups`` groups of :math:`C/G` channels; each group's
    :math:`(C/G)\cdot\prod \text{spatial}` elements are normalized together (the moments of
    :func:`~lightning_dvi.moments.layer_norm.normalize_diag`), then the per-channel affine
    :math:`\gamma_c, \beta_c` applies. Per-unit (diag) moments in every moment mode: a
    full-covariance input is refused (run the layer on diag moments, or use
    :class:`LayerNorm` for ``num_groups=1`` on flat inputs).

    Args:
        num_groups: :math:`G`, dividing ``num_channels``.
        num_channels: :math:`C`.
        eps: :math:`\epsilon`.
        affine: learn :math:`\gamma, \beta` (point parameters).

    Examples:
        >>> gn = GroupNorm(2, 4)
        >>> tuple(gn(torch.randn(3, 4, 5, 5), mode="diag").shape)
        (3, 4, 5, 5)
    """

    image_output = None
    point_parameters = ("weight", "bias")

    def __init__(
        self, num_groups: int, num_channels: int, eps: float = 1e-5, affine: bool = True
    ) -> None:
        super().__init__()
        if num_groups < 1 or num_channels < 1 or num_channels % num_groups:
            raise ValueError(
                f"GroupNorm: num_channels ({num_channels}) must be a positive multiple of "
                f"num_groups ({num_groups})"
            )
        if not eps > 0:
            raise ValueError(f"GroupNorm: eps must be positive, got {eps!r}")
        self.num_groups, self.num_channels = int(num_groups), int(num_channels)
        self.eps = float(eps)
        self.affine = affine
        self.weight: nn.Parameter | None = None
        self.bias: nn.Parameter | None = None
        if affine:
            self.weight = nn.Parameter(torch.ones(num_channels))
            self.bias = nn.Parameter(torch.zeros(num_channels))

    def _check(self, x: Moments, mode: Propagation) -> tuple[int, ...]:
        user = _user_shape(x, mode)
        if len(user) < 2 or user[1] != self.num_channels:
            raise ValueError(
                f"GroupNorm({self.num_groups}, {self.num_channels}) expects input of shape "
                f"[B, {self.num_channels}, *], got shape {user}"
            )
        if isinstance(x, Gaussian) and x.is_full:
            raise ValueError(
                f"GroupNorm needs per-unit (diag) moments, got a full-covariance Gaussian of "
                f"shape {user}; use LayerNorm for num_groups=1 on flat inputs"
            )
        _check_dtype("GroupNorm", x, self.weight)
        return user

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """Normalize a tensor (any mode) or per-unit moments, group by group."""
        user = self._check(x, mode)
        if isinstance(x, Tensor):
            if mode.samples:
                out = F.group_norm(
                    x.flatten(0, 1), self.num_groups, self.weight, self.bias, self.eps
                )
                return out.reshape(x.shape)
            return F.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        grouped = (user[0], self.num_groups, -1)
        mean, var = L.normalize_diag(x.mean.reshape(grouped), x.var.reshape(grouped), self.eps)
        mean, var = mean.reshape(user), var.reshape(user)
        if self.weight is not None and self.bias is not None:
            channel = (-1, *([1] * (len(user) - 2)))
            scale, shift = self.weight.reshape(channel), self.bias.reshape(channel)
            mean, var = N.affine_diag(mean, var, scale, shift)
        return Gaussian(mean, var=var, validate=False)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: Propagation) -> Tensor:
        """Not supported: GroupNorm keeps per-unit moments (no cross-covariance rule)."""
        raise NotImplementedError(
            "GroupNorm cannot be used inside a Residual block of flat moments; use LayerNorm"
        )

    def extra_repr(self) -> str:
        """Options for ``repr``."""
        return f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}"
