r"""The op table of the moment pass: which rule answers which torch op, and the refusal error.

Both :mod:`~lightning_dvi.pyro.moment_tensor` (the tensor that dispatches) and
:mod:`~lightning_dvi.pyro.moment_rules` (the rules that register) import this module and not
each other. An op without a registered rule is looked up in the activation registry
(:func:`lightning_dvi.nn.registry.spec_for_function`) by the resolver that ``moment_rules``
installs, so every declared activation works in the moment pass without Pyro-side code.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import resolve_name

__all__ = ["LAYER_OPS", "handler_for", "op_name", "register", "register_resolver", "unsupported"]

Handler = Callable[..., Any]
_H = TypeVar("_H", bound=Handler)
_HANDLERS: dict[Callable[..., Any], Handler] = {}
_RESOLVERS: list[Callable[[Callable[..., Any]], Handler | None]] = []
_HINT = (
    "The DVI moment pass propagates (mean, variance) only through F.linear / nn.Linear, "
    "matmul, the registered activations (lightning_dvi.nn.activation_specs(): torch.relu, ...), "
    "addition, scaling by constants and shape ops. Rewrite the model with these (or with "
    "lightning_dvi.nn modules), or train it with pyro.infer.Trace_ELBO."
)

# Ops whose second and third arguments are a layer's weight and bias (a sampled value there is
# refused: see moment_tensor.SampledTensor).
LAYER_OPS = frozenset(
    {
        torch.Tensor.__matmul__,
        torch.Tensor.matmul,
        torch.matmul,
        torch.nn.functional.linear,
        torch.nn.functional.conv2d,
    }
)


def unsupported(what: str, detail: str = "") -> NotImplementedError:
    """The error raised for anything the moment pass cannot do exactly."""
    text = f"{what} is not supported in a DVI moment pass"
    return NotImplementedError(f"{text}{': ' + detail if detail else ''}. {_HINT}")


def op_name(func: Callable[..., Any]) -> str:
    """A readable name of a torch op for error messages."""
    try:
        return resolve_name(func) or repr(func)
    except Exception:  # pragma: no cover - resolve_name is best effort
        return repr(func)


def register(*funcs: Callable[..., Any]) -> Callable[[_H], _H]:
    """Decorator: ``handler(func, *args, **kwargs)`` answers the listed torch ops."""

    def deco(handler: _H) -> _H:
        for f in funcs:
            _HANDLERS[f] = handler
        return handler

    return deco


def register_resolver(resolver: Callable[[Callable[..., Any]], Handler | None]) -> None:
    """Add a fallback that maps an op without a registered rule to a handler (or ``None``)."""
    _RESOLVERS.append(resolver)


def handler_for(func: Callable[..., Any]) -> Handler:
    """The rule for ``func``.

    Raises:
        NotImplementedError: naming the op, when no rule or resolver answers it.
    """
    handler = _HANDLERS.get(func)
    if handler is not None:
        return handler
    for resolve in _RESOLVERS:
        handler = resolve(func)
        if handler is not None:
            return handler
    raise unsupported(f"`{op_name(func)}` on a moment-carrying tensor")
