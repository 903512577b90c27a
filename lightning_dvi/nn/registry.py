"""One registry of layer kinds, shared by every front-end.

A kind (activation, weight layer, pooling, normalization, shape op, container) is declared once,
with :func:`register_layer` (or its shorthands :func:`register_activation` and
:func:`register_converter`): the declared module (whose ``propagate`` calls the kind's moment
function in :mod:`lightning_dvi.moments`), the torch modules and torch functions it stands for,
and how it is built from one of them. Conversion of a torch network
(:func:`lightning_dvi.nn.from_torch`), the safe torch-file table
(:mod:`lightning_dvi.nn.torch_file`) and the Pyro moment pass (``torch.relu(x)`` on a
moment-carrying tensor) all look kinds up here, and nowhere else.

What holds a weight posterior is *not* decided here: the KL term, empirical Bayes and the Pyro
sample sites find weight layers by the :class:`~lightning_dvi.nn.HasPosterior` protocol, so a
layer that is never registered (only built by hand) still gets them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from .base import BayesModule
from .posterior import set_posterior

__all__ = [
    "ActivationSpec",
    "ConversionOptions",
    "Converter",
    "LayerKind",
    "LayerSpec",
    "activation_specs",
    "copy_torch_posterior",
    "layer_specs",
    "register_activation",
    "register_converter",
    "register_layer",
    "spec_for_function",
    "spec_for_module",
    "torch_module_types",
]

_M = TypeVar("_M", bound=type[BayesModule])

LayerKind = Literal[
    "activation", "weight", "pooling", "normalization", "shape", "container", "dropped"
]
"""What a declared kind is (``"dropped"``: a torch layer that conversion removes, e.g. dropout)."""

Init = Literal["torch", "fresh"]


@dataclass(frozen=True)
class ConversionOptions:
    """What :func:`~lightning_dvi.nn.from_torch` was asked for; handed to every converter.

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
"""``(torch module, options) -> declared module``, or ``None`` to drop the layer."""


@dataclass(frozen=True)
class LayerSpec:
    """One declared layer kind.

    Attributes:
        name: the registry key (lower case, e.g. ``"relu"``, ``"linear"``).
        kind: what it is (:data:`LayerKind`).
        cls: the declared :class:`~lightning_dvi.nn.BayesModule` subclass (``None`` for a
            dropped torch layer).
        torch_modules: torch module classes it replaces (``nn.ReLU``, ``nn.Linear``).
        torch_functions: torch callables it replaces (``torch.relu``, ``F.relu``, ``Tensor.relu``).
        convert: builds the declared module from a torch module and the conversion options
            (``None`` drops the layer); defaults to :attr:`from_module`, then ``cls()``.
        from_module: builds the declared module from a torch module alone (reads e.g.
            ``negative_slope``).
        from_call: builds the declared module from the extra arguments of a torch function call
            (everything after the input tensor); defaults to ``cls(**kwargs)`` for a kind with
            :attr:`describe`, else to ``cls()`` rejecting arguments.
        describe: the keyword arguments of :attr:`from_call` (by default: of ``cls``) that
            rebuild a converted (declared) module, as plain data; a converted graph stores a
            module this way when its torch layer's constructor arguments cannot describe it
            (``None``: store the torch layer's arguments).
    """

    name: str
    kind: LayerKind
    cls: type[BayesModule] | None
    torch_modules: tuple[type[nn.Module], ...] = ()
    torch_functions: tuple[Callable[..., Any], ...] = ()
    convert: Converter | None = field(default=None, compare=False)
    from_module: Callable[[nn.Module], BayesModule] | None = field(default=None, compare=False)
    from_call: Callable[..., BayesModule] | None = field(default=None, compare=False)
    describe: Callable[[BayesModule], dict[str, Any]] | None = field(default=None, compare=False)

    def convert_module(self, module: nn.Module, options: ConversionOptions) -> BayesModule | None:
        """The declared module equivalent to the torch ``module`` (``None``: drop it)."""
        if self.convert is not None:
            return self.convert(module, options)
        return self.build_from_module(module)

    def build_from_module(self, module: nn.Module) -> BayesModule:
        """The declared module equivalent to the torch ``module``, built from it alone."""
        if self.from_module is not None:
            return self.from_module(module)
        if self.cls is None:
            raise NotImplementedError(f"{self.name}: no declared module to build")
        return self.cls()

    def build_from_call(self, *args: Any, **kwargs: Any) -> BayesModule:
        """The declared module equivalent to ``func(x, *args, **kwargs)``."""
        if self.from_call is not None:
            return self.from_call(*args, **kwargs)
        if self.describe is not None and self.cls is not None and not args:
            return self.cls(**kwargs)  # the constructor arguments describe() recorded
        if args or kwargs or self.cls is None:
            raise NotImplementedError(
                f"{self.name}: extra arguments {args!r} {kwargs!r} are not supported"
            )
        return self.cls()


ActivationSpec = LayerSpec
"""The spec of an activation (a :class:`LayerSpec` of kind ``"activation"``)."""

_SPECS: dict[str, LayerSpec] = {}


def _add(spec: LayerSpec) -> None:
    if spec.name in _SPECS:
        raise ValueError(f"layer kind {spec.name!r} is already registered")
    _SPECS[spec.name] = spec


def register_layer(
    name: str,
    *,
    kind: LayerKind,
    torch_modules: tuple[type[nn.Module], ...] = (),
    torch_functions: tuple[Callable[..., Any], ...] = (),
    convert: Converter | None = None,
    from_module: Callable[[nn.Module], BayesModule] | None = None,
    from_call: Callable[..., BayesModule] | None = None,
    describe: Callable[[BayesModule], dict[str, Any]] | None = None,
) -> Callable[[_M], _M]:
    """Class decorator: declare a layer kind under ``name`` (see :class:`LayerSpec`).

    Examples:
        >>> {"linear", "relu", "avg_pool2d"} <= {s.name for s in layer_specs()}
        True
    """

    def decorate(cls: _M) -> _M:
        _add(
            LayerSpec(
                name,
                kind,
                cls,
                tuple(torch_modules),
                tuple(torch_functions),
                convert,
                from_module,
                from_call,
                describe,
            )
        )
        return cls

    return decorate


def register_activation(
    name: str,
    *,
    torch_modules: tuple[type[nn.Module], ...] = (),
    torch_functions: tuple[Callable[..., Any], ...] = (),
    from_module: Callable[[nn.Module], BayesModule] | None = None,
    from_call: Callable[..., BayesModule] | None = None,
) -> Callable[[_M], _M]:
    """Class decorator: :func:`register_layer` with ``kind="activation"``.

    Examples:
        >>> {"heaviside", "relu"} <= {s.name for s in activation_specs()}
        True
    """
    return register_layer(
        name, kind="activation", torch_modules=torch_modules, torch_functions=torch_functions,
        from_module=from_module, from_call=from_call,
    )  # fmt: skip


def register_converter(
    *torch_types: type[nn.Module], kind: LayerKind = "weight"
) -> Callable[[Converter], Converter]:
    """Function decorator: declare ``fn(module, options) -> BayesModule | None`` for torch types.

    A registry entry named after the function, with no declared class of its own (the
    converter builds one, or returns ``None`` to drop the layer). Prefer
    :func:`register_layer` on the declared class, which says the same in one place.
    """

    def decorate(fn: Converter) -> Converter:
        _add(LayerSpec(f"{fn.__module__}.{fn.__qualname__}", kind, None, torch_types, (), fn))
        return fn

    return decorate


def layer_specs(kind: LayerKind | None = None) -> tuple[LayerSpec, ...]:
    """Every registered kind (of ``kind``, if given), in registration order."""
    return tuple(s for s in _SPECS.values() if kind is None or s.kind == kind)


def activation_specs() -> tuple[LayerSpec, ...]:
    """Every registered activation, in registration order."""
    return layer_specs("activation")


def torch_module_types() -> tuple[type[nn.Module], ...]:
    """Every torch module class some registered kind stands for."""
    return tuple(t for s in _SPECS.values() for t in s.torch_modules)


def spec_for_module(module: nn.Module) -> LayerSpec | None:
    """The spec whose ``torch_modules`` contains ``type(module)`` exactly, else ``None``."""
    for spec in _SPECS.values():
        if type(module) in spec.torch_modules:
            return spec
    return None


def spec_for_function(func: Callable[..., Any]) -> LayerSpec | None:
    """The spec whose ``torch_functions`` contains ``func``, else ``None``."""
    for spec in _SPECS.values():
        if any(func is f for f in spec.torch_functions):
            return spec
    return None


def _moped_scale(w: Tensor, options: ConversionOptions) -> Tensor:
    if options.scale_fraction == 0:
        return torch.zeros_like(w)
    return (options.scale_fraction * w.abs()).clamp_min(options.min_scale)


def copy_torch_posterior(layer: nn.Module, module: nn.Module, options: ConversionOptions) -> None:
    """``init="torch"``: the torch ``weight``/``bias`` as posterior means, MOPED scales.

    Writes through :func:`~lightning_dvi.nn.set_posterior` (any layer with ``weight_loc``,
    ``weight_raw_scale``, ... and ``scale_transform``).
    """
    if options.init != "torch":
        return
    weight = module.weight
    bias = module.bias
    if not isinstance(weight, Tensor) or not (bias is None or isinstance(bias, Tensor)):
        raise ValueError(f"{type(module).__name__} has no weight tensor to copy")
    w = weight.detach()
    b = None if bias is None else bias.detach()
    set_posterior(
        layer,
        w,
        _moped_scale(w, options),
        b,
        None if b is None else _moped_scale(b, options),
    )
