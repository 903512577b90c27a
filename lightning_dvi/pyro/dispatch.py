r"""The op table of the moment pass: which rule answers which torch op, and the refusal error.

Both :mod:`~lightning_dvi.pyro.moment_tensor` (the tensor that dispatches) and
:mod:`~lightning_dvi.pyro.moment_rules` (the rules that register) import this module and not
each other. An op without a registered rule is looked up in the layer registry
(:func:`lightning_dvi.nn.registry.spec_for_function`) by the resolver that ``moment_rules``
installs, so every declared activation (and the normalization and pooling kinds that declare
their torch functions) works in the moment pass without Pyro-side code. Every refusal lists
what does work, generated from this table and the registry (:func:`supported_ops`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.overrides import resolve_name

from ..nn.registry import layer_specs

__all__ = [
    "LAYER_OPS",
    "handler_for",
    "op_name",
    "register",
    "register_resolver",
    "supported_ops",
    "supported_ops_text",
    "unsupported",
]

Handler = Callable[..., Any]
_H = TypeVar("_H", bound=Handler)
_HANDLERS: dict[Callable[..., Any], Handler] = {}
_KINDS: dict[Callable[..., Any], str] = {}
_RESOLVERS: list[Callable[[Callable[..., Any]], Handler | None]] = []

# The order in which the groups of supported ops are listed; registry kinds map onto them.
_GROUPS = (
    "layers",
    "pooling",
    "normalization",
    "activations",
    "arithmetic",
    "shape ops",
    "likelihood links",
)
_REGISTRY_GROUPS = {
    "weight": "layers",
    "pooling": "pooling",
    "normalization": "normalization",
    "activation": "activations",
}

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
    """The error raised for anything the moment pass cannot do exactly.

    It names ``what`` failed (and why, ``detail``), then lists what does work
    (:func:`supported_ops_text`) and the ways out.
    """
    text = f"{what} is not supported in a DVI moment pass"
    return NotImplementedError(
        f"{text}{': ' + detail if detail else ''}. {supported_ops_text()}. Rewrite the model "
        "with these (or declare it with lightning_dvi.nn modules, e.g. from_torch(net), and "
        "wrap it in lightning_dvi.pyro.PyroBayesNet), or train it with pyro.infer.Trace_ELBO."
    )


_OPERATORS = {
    "__add__": "+",
    "__radd__": "+",
    "__sub__": "-",
    "__rsub__": "-",
    "__mul__": "*",
    "__rmul__": "*",
    "__truediv__": "/",
    "__matmul__": "@",
    "__getitem__": "indexing",
}


def _short(func: Callable[..., Any]) -> str:
    """The op's name as a user writes it, whatever its namespace: ``linear``, ``@``, ``mT``."""
    parts = op_name(func).removesuffix(".__get__").split(".")
    return _OPERATORS.get(parts[-1], parts[-1])


def supported_ops() -> dict[str, list[str]]:
    """What the moment pass answers on a moment-carrying tensor, by group, from the op table.

    The explicitly registered rules (:func:`register`, each with its group) and every torch
    function of the layer registry (:func:`lightning_dvi.nn.layer_specs`) that the registry
    resolver answers: activations, normalization and pooling kinds, through their declared
    modules. Generated on each call, so a kind registered later is listed too.

    Returns:
        ``{group: sorted op names}`` in a fixed group order, each name once whatever its
        namespace (``torch.``, ``torch.nn.functional.``, ``Tensor.``), operators as symbols,
        e.g. ``{"layers": ["@", "conv2d", "linear", "matmul"], ...}``.
    """
    groups: dict[str, set[str]] = {g: set() for g in _GROUPS}
    for func, kind in _KINDS.items():
        groups.setdefault(kind, set()).add(_short(func))
    for spec in layer_specs():
        group = _REGISTRY_GROUPS.get(spec.kind)
        if group is not None:
            groups[group].update(_short(f) for f in spec.torch_functions)
    return {g: sorted(names) for g, names in groups.items() if names}


def supported_ops_text() -> str:
    """One sentence listing :func:`supported_ops` (what every refusal says works)."""
    listed = "; ".join(f"{g}: {', '.join(names)}" for g, names in supported_ops().items())
    return (
        "The moment pass propagates (mean, variance) through these torch functions, "
        f"torch.nn.functional functions and Tensor methods: {listed} (activations also in "
        "place; the torch.nn modules that call them, e.g. nn.Conv2d, nn.MaxPool2d, "
        "nn.BatchNorm2d; and any lightning_dvi.nn network in a PyroBayesNet)"
    )


def op_name(func: Callable[..., Any]) -> str:
    """A readable name of a torch op for error messages."""
    try:
        name = resolve_name(func)
    except Exception:  # pragma: no cover - resolve_name is best effort
        name = None
    if name:
        return str(name)
    try:  # a function torch does not know (a user's, in the layer registry)
        return f"{func.__module__}.{func.__qualname__}"
    except AttributeError:
        return repr(func)


def register(*funcs: Callable[..., Any], kind: str) -> Callable[[_H], _H]:
    """Decorator: ``handler(func, *args, **kwargs)`` answers the listed torch ops.

    Args:
        *funcs: the torch ops.
        kind: the group the refusal message lists them under (``"layers"``, ``"pooling"``,
            ``"normalization"``, ``"arithmetic"``, ``"shape ops"``, ``"likelihood links"``);
            ``""`` for an op answered only to refuse it with a specific message.
    """

    def deco(handler: _H) -> _H:
        for f in funcs:
            _HANDLERS[f] = handler
            if kind:
                _KINDS[f] = kind
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
