r"""Saved torch networks as data: a layer list plus a ``state_dict``, never a pickle.

A torch network enters a YAML/CLI run through :class:`TorchNetwork`, which rebuilds the torch
``nn.Sequential`` from a **declarative layer list** (each layer's torch class name and
constructor arguments, e.g. ``{"type": "Linear", "in_features": 1, "out_features": 16}``),
loads its weights from a ``state_dict`` file read with ``torch.load(path, weights_only=True)``,
and converts it with :func:`~lightning_dvi.nn.from_torch`. Nothing is unpickled: a ``.pt``
holding a pickled module (``torch.save(module, path)``), which can run code when loaded, is
refused with the one-off migration to do for a file you trust.

:func:`save_torch_network` writes both parts into one file; :func:`describe_torch` gives the
layer list alone. Only layer types that :func:`~lightning_dvi.nn.from_torch` converts are
described or rebuilt (``Linear``, ``Conv2d``, the pools, ``Flatten``, ``Dropout``,
``Identity``, the registered activations, nested ``Sequential``, and types given a converter
with :func:`~lightning_dvi.nn.register_converter`), looked up by name in that table: a name in
a file never imports a module or calls anything else.
"""

from __future__ import annotations

import pickle
from collections.abc import Mapping
from os import PathLike
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .container import Sequential
from .convert import Init, from_torch
from .torch_layers import describe_layer as _describe
from .torch_layers import torch_from_description

__all__ = [
    "TorchNetwork",
    "describe_torch",
    "load_weights_only",
    "save_torch_network",
    "torch_from_description",
]

FILE_FORMAT = "lightning_dvi.torch_network"
FILE_VERSION = 1


def describe_torch(module: nn.Module) -> list[dict[str, Any]]:
    """The layer list of a torch network: plain data that :func:`torch_from_description` rebuilds.

    Args:
        module: an ``nn.Sequential`` (nested ones are kept nested, so ``state_dict`` keys match)
            or a single layer, made of the layer types :func:`~lightning_dvi.nn.from_torch`
            converts.

    Returns:
        One dictionary per layer: ``"type"`` (the ``torch.nn`` class name) and the constructor
        arguments read back from the layer (``bias`` as a bool).

    Raises:
        ValueError: for a layer type that cannot be described, or when the description does not
            rebuild a network with the same parameter names and shapes.

    Examples:
        >>> describe_torch(torch.nn.Sequential(torch.nn.Linear(1, 4), torch.nn.GELU()))
        [{'type': 'Linear', 'in_features': 1, 'out_features': 4, 'bias': True}, {'type': 'GELU', 'approximate': 'none'}]
    """
    children = module.named_children() if type(module) is nn.Sequential else [("", module)]
    layers = [_describe(child, name) for name, child in children]
    rebuilt = torch_from_description(layers)
    expected = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    if type(module) is not nn.Sequential:
        expected = {f"0.{k}": v for k, v in expected.items()}
    if expected != got:
        raise ValueError(
            f"the layer list does not rebuild {type(module).__name__}: parameters {expected} "
            f"became {got}"
        )
    return layers


def save_torch_network(module: nn.Module, path: str | PathLike[str]) -> Path:
    """Save a torch network as data for :class:`TorchNetwork`: its layer list and ``state_dict``.

    The file is a plain dictionary (``torch.load(path, weights_only=True)`` reads it), so
    loading it cannot run code. To convert a file written the old way,
    ``torch.save(module, "old.pt")``, load that one yourself, once, if you trust it::

        module = torch.load("old.pt", weights_only=False)   # runs the pickle: trusted files only
        save_torch_network(module, "net.pt")

    Args:
        module: the torch network (see :func:`describe_torch` for the supported layers).
        path: the file to write.

    Returns:
        ``path``, as a ``Path``.
    """
    prefix = "" if type(module) is nn.Sequential else "0."  # a single layer is wrapped
    state = {f"{prefix}{k}": v.detach().cpu() for k, v in module.state_dict().items()}
    payload = {
        "format": FILE_FORMAT,
        "version": FILE_VERSION,
        "layers": describe_torch(module),
        "state_dict": state,
    }
    torch.save(payload, path)
    return Path(path)


def load_weights_only(source: Any, what: str, advice: str = "", map_location: Any = "cpu") -> Any:
    """``torch.load(source, weights_only=True)``, its refusal turned into a clear ``ValueError``.

    The one place a file is read: tensors, numbers, strings and plain containers load; a file
    holding other pickled objects (which could run code) is refused, never unpickled.

    Args:
        source: a path or a binary file.
        what: the file's description for the message, e.g. ``"checkpoint ckpt/last.ckpt"``.
        advice: a sentence appended to the message (what to do instead).
        map_location: as in ``torch.load``.

    Raises:
        ValueError: ``refusing <what>: torch.load(path, weights_only=True) cannot read it ...``.
        FileNotFoundError: when there is no such file.
    """
    try:
        return torch.load(source, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise
    except (pickle.UnpicklingError, RuntimeError, EOFError) as err:
        raise ValueError(
            f"refusing {what}: torch.load(path, weights_only=True) cannot read it "
            f"({str(err).split('.')[0].strip()}); lightning_dvi never unpickles, since a file "
            f"holding pickled objects other than tensors and plain values can run code when "
            f"loaded. {advice}".rstrip()
        ) from err


def _read_weights(path: str) -> tuple[list[Any] | None, dict[str, Tensor]]:
    """The layer list (if the file has one) and the state dict of a weights-only file."""
    data = load_weights_only(
        path,
        f"weights file {path}",
        "If it is a pickled module (torch.save(module, path)) that you wrote and trust, convert "
        "it once: module = torch.load(path, weights_only=False); "
        "lightning_dvi.nn.save_torch_network(module, 'net.pt')",
    )
    if isinstance(data, Mapping) and data.get("format") == FILE_FORMAT:
        return list(data["layers"]), dict(data["state_dict"])
    if isinstance(data, Mapping) and all(isinstance(v, Tensor) for v in data.values()):
        return None, dict(data)
    raise ValueError(
        f"{path}: expected a file written by lightning_dvi.nn.save_torch_network or a "
        f"state_dict (torch.save(module.state_dict(), path)), got {type(data).__name__}"
    )


class TorchNetwork(Sequential):
    """A torch network, rebuilt from its layer list and weights, converted by :func:`from_torch`.

    The way to use a converted network from the CLI or YAML, where a network is given by class
    path and arguments::

        model:
          init_args:
            net:
              class_path: lightning_dvi.nn.TorchNetwork
              init_args: {path: my_mlp.pt, scale_fraction: 0.1}

    ``path`` is a file written by :func:`save_torch_network` (layer list and weights), or a
    plain ``state_dict`` (``torch.save(module.state_dict(), path)``) together with ``layers``.
    Both are read with ``torch.load(path, weights_only=True)``: nothing is unpickled, and a
    pickled module is refused with the migration to do. A CLI run records the layer list (not
    the path) in its checkpoints, so ``DVIRegressor.load_from_checkpoint`` rebuilds the
    architecture without the file and loads the trained posterior over it.

    Args:
        path: the weights file; ``None`` builds the architecture from ``layers`` alone
            (``init="fresh"``; how a checkpoint rebuilds it before loading its own weights).
        layers: the layer list (:func:`describe_torch`), needed when ``path`` holds only a
            ``state_dict``; must match the file's own list when both are given.
        init: ``"torch"`` (posterior means from the saved weights) or ``"fresh"``, as in
            :func:`from_torch`.
        scale_fraction: δ of the MOPED-style posterior std ``max(δ|w|, min_scale)``.
        min_scale: floor of the posterior std.
        rules: moment rules of submodules, ``{path: {attribute: value}}`` as
            :func:`lightning_dvi.nn.rules.module_rules` writes them (e.g.
            ``{"layers.1": {"route": "first_order"}}`` for a LayerNorm at index 1); a checkpoint
            records the network's rules here, so rules set after construction
            (:func:`~lightning_dvi.nn.posthoc.set_rules`) come back with it.

    Raises:
        ValueError: for a file that is not weights-only data (naming it and the migration), a
            state dict that does not fit the layers, a missing layer list, or rules the network
            does not have.
    """

    def __init__(
        self,
        path: str | None = None,
        layers: list[Any] | None = None,
        init: Init = "torch",
        scale_fraction: float = 0.1,
        min_scale: float = 1e-8,
        rules: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        state: dict[str, Tensor] | None = None
        if path is not None:
            saved_layers, state = _read_weights(str(path))
            if saved_layers is not None and layers is not None and saved_layers != list(layers):
                raise ValueError(f"{path}: the file's layer list differs from layers={layers!r}")
            layers = saved_layers if saved_layers is not None else layers
        elif init == "torch":
            raise ValueError("TorchNetwork: init='torch' needs a weights file (path=...)")
        if layers is None:
            raise ValueError(
                f"TorchNetwork: {path} holds only a state_dict; give its layer list with "
                "layers=[...] (lightning_dvi.nn.describe_torch(module)), or write the file with "
                "lightning_dvi.nn.save_torch_network(module, path)"
            )
        module = torch_from_description(layers)
        if state is not None:
            dtypes = {v.dtype for v in state.values() if v.is_floating_point()}
            if len(dtypes) == 1:
                module = module.to(dtypes.pop())
            try:
                module.load_state_dict(state)
            except RuntimeError as err:
                raise ValueError(f"{path}: the weights do not fit the layer list: {err}") from err
        converted = from_torch(
            module, init=init, scale_fraction=scale_fraction, min_scale=min_scale
        )
        super().__init__(*converted.layers)
        self.path = None if path is None else str(path)
        self.layer_list: list[Any] = [_plain_entry(e) for e in layers]
        if rules:
            from .rules import apply_rules

            apply_rules(self, rules, "TorchNetwork")

    def architecture(self) -> dict[str, Any]:
        """``init_args`` that rebuild this architecture without the weights file (for checkpoints).

        With the moment rules its modules have now (``rules``), when any module has one.
        """
        from .rules import module_rules

        out: dict[str, Any] = {"layers": self.layer_list, "init": "fresh"}
        rules = module_rules(self)
        if rules:
            out["rules"] = rules
        return out


def _plain_entry(entry: Any) -> Any:
    """A layer entry as plain dicts and lists (what checkpoints store)."""
    if isinstance(entry, Mapping):
        return {
            str(k): [_plain_entry(e) for e in v] if k == "layers" else v for k, v in entry.items()
        }
    return entry
