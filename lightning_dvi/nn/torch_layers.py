"""Torch layers as plain data: one layer's constructor arguments, and the layer rebuilt from them.

The table of torch layer types a description may name comes from the layer registry (every
torch module some registered kind stands for, and ``nn.Sequential``), looked up by name: a name
in a file never imports a module or calls anything else. Used by the torch-file format
(:mod:`lightning_dvi.nn.torch_file`) and by converted graph networks
(:class:`~lightning_dvi.nn.GraphNetwork`), which store their layers this way.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from .registry import torch_module_types

__all__ = [
    "build_layer",
    "describe_layer",
    "layer_types",
    "plain",
    "torch_from_description",
]

# Constructor arguments that do not describe the architecture.
_SKIPPED = {"self", "inplace", "device", "dtype"}
_Plain = (bool, int, float, str, type(None))


def layer_types() -> dict[str, type[nn.Module]]:
    """Every torch layer type a description may name: short names for ``torch.nn`` classes."""
    types: list[type[nn.Module]] = [nn.Sequential, *torch_module_types()]
    table: dict[str, type[nn.Module]] = {}
    for cls in types:
        short = cls.__name__
        name = short if getattr(nn, short, None) is cls else f"{cls.__module__}.{cls.__qualname__}"
        table[name] = cls
    return table


def _type_name(cls: type[nn.Module]) -> str:
    for name, known in layer_types().items():
        if known is cls:
            return name
    raise ValueError(
        f"{cls.__name__} cannot be described as data; supported layer types: "
        f"{', '.join(sorted(layer_types()))}"
    )


def plain(value: Any, where: str) -> Any:
    """``value`` if it is a number, string, bool or ``None`` (a tuple becomes a list), else raise."""
    if isinstance(value, _Plain):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _Plain) for v in value):
        return list(value)
    raise ValueError(f"{where} = {value!r} is not a plain value (number, string, bool, list)")


def describe_layer(module: nn.Module, where: str) -> dict[str, Any]:
    """One torch layer as ``{"type": name, **constructor arguments}`` (``bias`` as a bool)."""
    cls = type(module)
    entry: dict[str, Any] = {"type": _type_name(cls)}
    if cls is nn.Sequential:
        entry["layers"] = [
            describe_layer(child, f"{where}.{name}" if where else name)
            for name, child in module.named_children()
        ]
        return entry
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if name in _SKIPPED or parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        if name == "bias" and isinstance(getattr(module, "bias", None), (Tensor, type(None))):
            entry["bias"] = module.bias is not None
        elif hasattr(module, name):
            entry[name] = plain(getattr(module, name), f"{where or cls.__name__}.{name}")
    return entry


def build_layer(entry: object, where: str) -> nn.Module:
    """The torch layer an entry of :func:`describe_layer` describes (fresh weights)."""
    if isinstance(entry, str):
        entry = {"type": entry}
    if not isinstance(entry, Mapping) or "type" not in entry:
        raise ValueError(
            f"{where}: expected a layer name or a mapping with a 'type', got {entry!r}"
        )
    types = layer_types()
    cls = types.get(str(entry["type"]))
    if cls is None:
        raise ValueError(
            f"{where}: unknown layer type {entry['type']!r}; a layer list may name "
            f"{', '.join(sorted(types))} (looked up by name, never imported)"
        )
    kwargs = {
        str(k): plain(v, f"{where}.{k}") for k, v in entry.items() if k not in ("type", "layers")
    }
    if cls is nn.Sequential:
        if kwargs:
            raise ValueError(f"{where}: a Sequential takes only 'layers', got {sorted(kwargs)}")
        return torch_from_description(entry.get("layers") or [], where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: cannot build {entry['type']}: {err}") from err


def torch_from_description(layers: Sequence[Any], where: str = "layers") -> nn.Sequential:
    """The torch ``nn.Sequential`` a :func:`describe_torch` layer list describes (fresh weights).

    Args:
        layers: layer entries: a mapping with ``"type"`` (a ``torch.nn`` class name from the
            supported table) and constructor arguments, or just the name; a nested
            ``{"type": "Sequential", "layers": [...]}`` stays nested.
        where: a name for the list in error messages.

    Raises:
        ValueError: naming the entry, for an unknown type or arguments that are not plain values.
    """
    if isinstance(layers, (str, bytes)) or not isinstance(layers, Sequence):
        raise ValueError(f"{where} must be a list of layers, got {type(layers).__name__}")
    return nn.Sequential(*(build_layer(e, f"{where}[{i}]") for i, e in enumerate(layers)))
