"""One registry of elementwise activations, shared by every front-end.

Each declared activation module registers itself here once, with the torch modules and torch
functions it stands for. Conversion of a torch network (``nn.ReLU()`` -> :class:`ReLU`) and the
Pyro moment pass (``torch.relu(x)`` on a moment-carrying tensor) both look the activation up here,
so adding an activation is: a moment function in :mod:`lightning_dvi.moments`, a thin module in
:mod:`lightning_dvi.nn` decorated with :func:`register_activation`, and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from .base import BayesModule

__all__ = [
    "ActivationSpec",
    "activation_specs",
    "register_activation",
    "spec_for_function",
    "spec_for_module",
]

_M = TypeVar("_M", bound=type[BayesModule])


@dataclass(frozen=True)
class ActivationSpec:
    """How one declared activation stands for torch modules and functions.

    Attributes:
        name: the registry key (lower case, e.g. ``"relu"``).
        cls: the declared :class:`~lightning_dvi.nn.BayesModule` subclass.
        torch_modules: torch module classes it replaces (``nn.ReLU``).
        torch_functions: torch callables it replaces (``torch.relu``, ``F.relu``, ``Tensor.relu``).
        from_module: builds the declared module from a torch module instance (reads e.g.
            ``negative_slope``); defaults to ``cls()``.
        from_call: builds the declared module from the extra arguments of a torch function call
            (everything after the input tensor); defaults to ``cls()`` and rejects arguments.
    """

    name: str
    cls: type[BayesModule]
    torch_modules: tuple[type[nn.Module], ...] = ()
    torch_functions: tuple[Callable[..., Any], ...] = ()
    from_module: Callable[[nn.Module], BayesModule] | None = field(default=None, compare=False)
    from_call: Callable[..., BayesModule] | None = field(default=None, compare=False)

    def build_from_module(self, module: nn.Module) -> BayesModule:
        """The declared module equivalent to the torch ``module``."""
        return self.from_module(module) if self.from_module is not None else self.cls()

    def build_from_call(self, *args: Any, **kwargs: Any) -> BayesModule:
        """The declared module equivalent to ``func(x, *args, **kwargs)``."""
        if self.from_call is not None:
            return self.from_call(*args, **kwargs)
        if args or kwargs:
            raise NotImplementedError(
                f"{self.name}: extra arguments {args!r} {kwargs!r} are not supported"
            )
        return self.cls()


_SPECS: dict[str, ActivationSpec] = {}


def register_activation(
    name: str,
    *,
    torch_modules: tuple[type[nn.Module], ...] = (),
    torch_functions: tuple[Callable[..., Any], ...] = (),
    from_module: Callable[[nn.Module], BayesModule] | None = None,
    from_call: Callable[..., BayesModule] | None = None,
) -> Callable[[_M], _M]:
    """Class decorator: register a declared activation under ``name``.

    Examples:
        >>> {"heaviside", "relu"} <= {s.name for s in activation_specs()}
        True
    """

    def decorate(cls: _M) -> _M:
        if name in _SPECS:
            raise ValueError(f"activation {name!r} is already registered")
        _SPECS[name] = ActivationSpec(
            name, cls, tuple(torch_modules), tuple(torch_functions), from_module, from_call
        )
        return cls

    return decorate


def activation_specs() -> tuple[ActivationSpec, ...]:
    """Every registered activation, in registration order."""
    return tuple(_SPECS.values())


def spec_for_module(module: nn.Module) -> ActivationSpec | None:
    """The spec whose ``torch_modules`` contains ``type(module)`` exactly, else ``None``."""
    for spec in _SPECS.values():
        if type(module) in spec.torch_modules:
            return spec
    return None


def spec_for_function(func: Callable[..., Any]) -> ActivationSpec | None:
    """The spec whose ``torch_functions`` contains ``func``, else ``None``."""
    for spec in _SPECS.values():
        if any(func is f for f in spec.torch_functions):
            return spec
    return None
