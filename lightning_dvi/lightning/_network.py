"""The network of a DVI LightningModule: a placeholder until the data give its width.

Also rebuilding an injected network from the configuration a CLI checkpoint saved.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["UnbuiltNetwork", "instantiate_net", "primitive"]


def instantiate_net(config: Mapping[str, Any]) -> nn.Module:
    """Build a network from ``{"class_path": ..., "init_args": {...}}`` (how the CLI saves it).

    Nested ``class_path`` dictionaries in ``init_args`` are built first (jsonargparse's form).

    Raises:
        ValueError: without a ``class_path``.
    """
    if "class_path" not in config:
        raise ValueError(f"a network configuration needs a class_path, got keys {sorted(config)}")

    def build(value: Any) -> Any:
        if isinstance(value, Mapping) and "class_path" in value:
            module_name, _, class_name = str(value["class_path"]).rpartition(".")
            cls = getattr(importlib.import_module(module_name), class_name)
            return cls(**{k: build(v) for k, v in dict(value.get("init_args") or {}).items()})
        if isinstance(value, (list, tuple)):
            return [build(v) for v in value]
        return value

    net: nn.Module = build(config)
    return net


def primitive(value: Any) -> Any:
    """A plain-container copy (dicts, lists, scalars) of a jsonargparse configuration."""
    if type(value).__name__ == "Namespace":
        value = vars(value)
    if isinstance(value, Mapping):
        return {str(k): primitive(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [primitive(v) for v in value]
    return value


class UnbuiltNetwork(nn.Module):
    """Stands in for the network until ``setup()`` has read ``in_features`` from the data."""

    def __init__(self, owner: str) -> None:
        super().__init__()
        self.owner = owner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Raise: there is no network yet."""
        raise RuntimeError(
            f"{self.owner}: the network is not built yet. It was created without in_features, "
            "which is read from the data when a Trainer runs it (trainer.fit / validate / test / "
            "predict call setup()); pass in_features= to use the model before that"
        )
