r"""Convert a torch ``nn.Sequential`` into a declared DVI network (:func:`from_torch`).

Each torch layer maps to a declared module: ``nn.Linear`` to :class:`BayesLinear`, activations
through the registry (:mod:`lightning_dvi.nn.registry`: ``nn.ReLU``, ``nn.LeakyReLU``,
``nn.GELU``, ``nn.SiLU``, ``nn.Tanh``, ``nn.Sigmoid``, ...), ``nn.Flatten`` to a flatten module,
and ``nn.Dropout``/``nn.Identity`` are dropped (DVI's weight posterior replaces dropout's noise).
Nested ``nn.Sequential`` containers are flattened in order. Anything else raises an error naming
the layer and its position. ``nn.Conv2d`` becomes :class:`~lightning_dvi.nn.BayesConv2d`
(``groups=1``, no dilation), ``nn.AvgPool2d``/``nn.MaxPool2d`` the moment-propagating pools;
converters for further layer types plug in through :func:`register_converter`.

**Posterior initialisation** (``init="torch"``, in the spirit of MOPED, Krishnan et al. 2020):
the posterior means are the torch weights and biases, and the posterior standard deviations are
a fraction of their magnitude,

.. math::
    q(w) = \mathcal N\big(w_{\text{torch}},\ (\delta\,|w_{\text{torch}}|)^2\big),
    \qquad \delta = \texttt{scale\_fraction},

floored at ``min_scale`` (so that a weight that is exactly zero still gets a positive scale and a
finite KL). ``scale_fraction=0`` sets every scale to exactly zero (the raw parameter is
:math:`-\infty` under either scale transform): the network is then the deterministic torch
network, in every mode, which is what export and round-trip checks want, but its KL is infinite,
so do not train it. The prior stays the library's zero-mean prior (MOPED's prior centred on the
pretrained weights is not implemented). ``init="fresh"`` keeps only the architecture.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import torch
from torch import Tensor, nn

from ..gaussian import Gaussian
from .base import BayesModule, Moments
from .container import Sequential
from .conv import (
    AvgPool2d,
    BayesConv2d,
    MaxPool2d,
    _pair,
    unsupported_conv2d_options,
    unsupported_pool2d_options,
)
from .linear import BayesLinear
from .registry import spec_for_module

__all__ = [
    "ConversionOptions",
    "TorchFlatten",
    "from_torch",
    "register_converter",
    "set_posterior",
]

Init = Literal["torch", "fresh"]


@dataclass(frozen=True)
class ConversionOptions:
    """What :func:`from_torch` was asked for; handed to every layer converter.

    Attributes:
        init: ``"torch"`` (posterior means from the torch weights) or ``"fresh"``.
        scale_fraction: δ, posterior std as a fraction of ``|w|``.
        min_scale: floor of the posterior std (``scale_fraction > 0`` only).
        layer_kwargs: extra keyword arguments for every Bayesian layer's constructor.
    """

    init: Init
    scale_fraction: float
    min_scale: float
    layer_kwargs: dict[str, Any]


Converter = Callable[[nn.Module, ConversionOptions], BayesModule | None]
_CONVERTERS: dict[type[nn.Module], Converter] = {}


def register_converter(*torch_types: type[nn.Module]) -> Callable[[Converter], Converter]:
    """Register ``fn(module, options) -> BayesModule | None`` for torch layer types.

    The converter returns the declared module, or ``None`` to drop the layer. Activations do not
    need one (they are found through :func:`~lightning_dvi.nn.register_activation`).
    """

    def decorate(fn: Converter) -> Converter:
        for t in torch_types:
            _CONVERTERS[t] = fn
        return fn

    return decorate


def _raw_from_scale(scale: Tensor, transform: str) -> Tensor:
    """Inverse of the layer's positive transform; a zero scale maps to ``-inf`` exactly."""
    if transform == "exp":
        return scale.log()
    # softplus^{-1}(s) = s + log(-expm1(-s)); equals log(0) = -inf at s = 0
    return scale + torch.log(-torch.expm1(-scale))


@torch.no_grad()
def set_posterior(
    layer: nn.Module,
    weight_loc: Tensor,
    weight_scale: Tensor,
    bias_loc: Tensor | None = None,
    bias_scale: Tensor | None = None,
) -> None:
    """Write posterior means and standard deviations into a Bayesian layer in place.

    Works for any layer with ``weight_loc``, ``weight_raw_scale`` (and ``bias_loc``,
    ``bias_raw_scale``) parameters and a ``scale_transform`` attribute, such as
    :class:`BayesLinear`. Scales must be non-negative; zero is represented exactly.

    Raises:
        ValueError: on shape mismatches or negative / non-finite values.
    """
    pairs: list[tuple[str, Tensor | None, Tensor | None]] = [("weight", weight_loc, weight_scale)]
    if bias_loc is not None or bias_scale is not None:
        if getattr(layer, "bias_loc", None) is None:
            raise ValueError(f"{type(layer).__name__} has no bias to set")
        pairs.append(("bias", bias_loc, bias_scale))
    for name, loc, scale in pairs:
        param_loc = getattr(layer, f"{name}_loc")
        param_raw = getattr(layer, f"{name}_raw_scale")
        if loc is None or scale is None:
            raise ValueError(f"{name}: give both the mean and the scale")
        if loc.shape != param_loc.shape or scale.shape != param_loc.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(param_loc.shape)}, got mean "
                f"{tuple(loc.shape)} and scale {tuple(scale.shape)}"
            )
        if not torch.isfinite(loc).all() or not torch.isfinite(scale).all() or (scale < 0).any():
            raise ValueError(f"{name}: means must be finite and scales finite and >= 0")
        param_loc.copy_(loc)
        transform = cast(str, layer.scale_transform)  # an attribute such layers have (above)
        param_raw.copy_(_raw_from_scale(scale.to(param_raw), transform))


def _moped_scale(w: Tensor, options: ConversionOptions) -> Tensor:
    if options.scale_fraction == 0:
        return torch.zeros_like(w)
    return (options.scale_fraction * w.abs()).clamp_min(options.min_scale)


@register_converter(nn.Linear)
def _convert_linear(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.Linear)
    layer = BayesLinear(
        module.in_features,
        module.out_features,
        bias=module.bias is not None,
        **options.layer_kwargs,
    ).to(device=module.weight.device, dtype=module.weight.dtype)
    if options.init == "torch":
        _copy_posterior(layer, module, options)
    return layer


def _copy_posterior(
    layer: nn.Module, module: nn.Linear | nn.Conv2d, options: ConversionOptions
) -> None:
    w = module.weight.detach()
    b = None if module.bias is None else module.bias.detach()
    set_posterior(
        layer,
        w,
        _moped_scale(w, options),
        b,
        None if b is None else _moped_scale(b, options),
    )


@register_converter(nn.Conv2d)
def _convert_conv2d(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.Conv2d)
    required = unsupported_conv2d_options(
        module.groups, module.dilation, module.padding, module.padding_mode
    )
    if required is not None:
        raise NotImplementedError(f"only Conv2d with {required} is supported")
    padding = cast("int | tuple[int, ...]", module.padding)  # a str padding was refused above
    layer = BayesConv2d(
        module.in_channels,
        module.out_channels,
        _pair(module.kernel_size, "kernel_size"),
        stride=_pair(module.stride, "stride"),
        padding=_pair(padding, "padding"),
        bias=module.bias is not None,
        **options.layer_kwargs,
    ).to(device=module.weight.device, dtype=module.weight.dtype)
    if options.init == "torch":
        _copy_posterior(layer, module, options)
    return layer


@register_converter(nn.AvgPool2d, nn.MaxPool2d)
def _convert_pool2d(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, (nn.AvgPool2d, nn.MaxPool2d))
    required = unsupported_pool2d_options(
        module.padding,
        module.ceil_mode,
        getattr(module, "dilation", 1),
        getattr(module, "divisor_override", None),
        getattr(module, "return_indices", False),
    )
    if required is not None:
        raise NotImplementedError(f"only {type(module).__name__} with {required} is supported")
    cls = AvgPool2d if isinstance(module, nn.AvgPool2d) else MaxPool2d
    return cls(module.kernel_size, module.stride)


@register_converter(
    nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.Identity
)
def _drop(module: nn.Module, options: ConversionOptions) -> None:
    return None


class TorchFlatten(BayesModule):
    """``torch.nn.Flatten`` for converted networks: flattens tensors (any mode) and diag Gaussians.

    Unlike :class:`lightning_dvi.nn.Flatten` (images ``[B, C, H, W]`` only, for declared CNNs)
    it keeps ``torch.nn.Flatten``'s ``start_dim``/``end_dim`` and lets flat inputs through, as
    the torch module does, so a converted network accepts what the torch one accepted.

    In the Monte Carlo modes the leading sample dimension is kept out of the flattened range.
    A full-covariance Gaussian is already flat (``[B, D]``) and passes through unchanged.

    Args:
        start_dim: first dimension to flatten (counted without the sample dimension).
        end_dim: last dimension to flatten.
    """

    def __init__(self, start_dim: int = 1, end_dim: int = -1) -> None:
        super().__init__()
        self.start_dim, self.end_dim = int(start_dim), int(end_dim)

    def _dims(self, offset: int) -> tuple[int, int]:
        start = self.start_dim + offset if self.start_dim >= 0 else self.start_dim
        end = self.end_dim + offset if self.end_dim >= 0 else self.end_dim
        return start, end

    def propagate(self, x: Moments, mode: str) -> Moments:
        """Flatten the tensor (or the diag Gaussian's mean and variance)."""
        if isinstance(x, Gaussian):
            if x.is_full:
                if x.mean.dim() != 2:
                    raise ValueError("Flatten: a full-covariance Gaussian must be [B, D]")
                return x
            start, end = self._dims(0)
            return Gaussian(x.mean.flatten(start, end), var=x.var.flatten(start, end))
        start, end = self._dims(1 if mode in ("sample", "local") else 0)
        return x.flatten(start, end)

    def propagate_cross(self, cross: Tensor, x: Gaussian, mode: str) -> Tensor:
        """Identity on flat inputs (Residual branches carry ``[B, D]`` moments)."""
        if x.mean.dim() != 2:
            raise ValueError("Flatten inside a Residual block needs a flat [B, D] input")
        return cross

    def extra_repr(self) -> str:
        """The flattened dimensions."""
        return f"start_dim={self.start_dim}, end_dim={self.end_dim}"


@register_converter(nn.Flatten)
def _convert_flatten(module: nn.Module, options: ConversionOptions) -> BayesModule:
    assert isinstance(module, nn.Flatten)
    return TorchFlatten(module.start_dim, module.end_dim)


def _leaves(module: nn.Module, path: str) -> Iterator[tuple[str, nn.Module]]:
    if type(module) is nn.Sequential:
        for name, child in module.named_children():
            yield from _leaves(child, f"{path}.{name}" if path else name)
    else:
        yield path or type(module).__name__, module


_SUPPORTED = (
    "Linear, Conv2d, AvgPool2d, MaxPool2d, Flatten, Dropout (dropped), Identity (dropped), "
    "nested Sequential, and the registered activations"
)


def from_torch(
    module: nn.Module,
    init: Init = "torch",
    scale_fraction: float = 0.1,
    min_scale: float = 1e-8,
    **layer_kwargs: Any,
) -> Sequential:
    r"""Convert a torch ``nn.Sequential`` (or a single layer) into a declared DVI network.

    Args:
        module: a torch ``nn.Sequential`` (nested ones are flattened) or a single layer.
        init: ``"torch"``: posterior means from the torch weights, scales
            ``max(scale_fraction * |w|, min_scale)`` (MOPED-style); ``"fresh"``: the declared
            layers' own initialisation (only the architecture is kept).
        scale_fraction: :math:`\delta \ge 0`; ``0`` gives exactly zero posterior scales, a
            deterministic copy of the torch network (infinite KL: for export and checks).
        min_scale: floor of the posterior std when ``scale_fraction > 0``.
        **layer_kwargs: forwarded to every :class:`BayesLinear` (e.g. ``prior_variance``,
            ``scale_transform``, and ``init_scale`` for ``init="fresh"``).

    Returns:
        A :class:`~lightning_dvi.nn.Sequential` of declared modules, on the torch weights'
        device and dtype.

    Raises:
        NotImplementedError: for a layer that cannot be converted, naming its position and
            path, e.g. ``layer 3 (2.1): BatchNorm1d is not supported``.
        ValueError: on bad options or a network with nothing left to convert.

    Examples:
        >>> torch_net = torch.nn.Sequential(
        ...     torch.nn.Linear(3, 8), torch.nn.GELU(), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2)
        ... )
        >>> net = from_torch(torch_net, scale_fraction=0.0)
        >>> [type(m).__name__ for m in net]
        ['BayesLinear', 'GELU', 'BayesLinear']
        >>> x = torch.randn(4, 3)
        >>> out = net(x, mode="diag")
        >>> torch.allclose(out.mean, torch_net.eval()(x), atol=1e-6), out.var.abs().max().item()
        (True, 0.0)
    """
    if init not in ("torch", "fresh"):
        raise ValueError(f"init must be 'torch' or 'fresh', got {init!r}")
    if not isinstance(module, nn.Module):
        raise TypeError(f"from_torch needs a torch.nn.Module, got {type(module).__name__}")
    for name, value in (("scale_fraction", scale_fraction), ("min_scale", min_scale)):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{name} must be a number, got {value!r}")
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be finite and >= 0, got {value!r}")
    if scale_fraction > 0 and min_scale <= 0:
        raise ValueError("min_scale must be > 0 when scale_fraction > 0 (finite KL)")
    options = ConversionOptions(init, float(scale_fraction), float(min_scale), dict(layer_kwargs))
    layers: list[BayesModule] = []
    for position, (path, leaf) in enumerate(_leaves(module, ""), start=1):
        converted = _convert_leaf(leaf, options, position, path)
        if converted is not None:
            layers.append(converted)
    if not layers:
        raise ValueError("from_torch: nothing left to convert (only dropped layers)")
    return Sequential(*layers)


def _convert_leaf(
    leaf: nn.Module, options: ConversionOptions, position: int, path: str
) -> BayesModule | None:
    where = f"layer {position} ({path}): {type(leaf).__name__}"
    if isinstance(leaf, BayesModule):
        raise NotImplementedError(f"{where} is already a lightning_dvi module")
    converter = _CONVERTERS.get(type(leaf))
    try:
        if converter is not None:
            return converter(leaf, options)
        spec = spec_for_module(leaf)
        if spec is not None:
            return spec.build_from_module(leaf)
    except (NotImplementedError, ValueError) as err:
        raise NotImplementedError(f"{where} cannot be converted: {err}") from err
    raise NotImplementedError(f"{where} is not supported; from_torch converts {_SUPPORTED}")
