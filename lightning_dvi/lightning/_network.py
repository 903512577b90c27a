"""The network of a DVI LightningModule: an injected one, or the built-in MLP.

The constructor's network arguments are resolved here, once: an injected network (checked
against the likelihood's width), one rebuilt from the configuration a CLI checkpoint saved, or
the MLP's architecture (:class:`MLPConfig`), built at once when both widths are known and
otherwise a placeholder until ``setup()`` reads the input width from the data.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..nn import BayesLinear, BayesModule, bayes_layers, mlp
from ..nn.builders import Activation
from ._validation import check, is_int, one_of, positive_float

__all__ = [
    "MLP_ARGUMENTS",
    "MLPConfig",
    "UnbuiltNetwork",
    "check_net",
    "instantiate_net",
    "primitive",
    "setup_network",
]

# The constructor arguments that only describe the built-in MLP (not recorded with an injected net).
MLP_ARGUMENTS = ("hidden", "activation", "residual", "init_scale")


@dataclass
class MLPConfig:
    r"""The built-in MLP's architecture, checked on construction, built once the widths are known.

    Args:
        hidden: hidden-layer widths (positive ints; may be empty).
        activation: ``"relu"`` or ``"heaviside"``.
        residual: skip connections between equal-width hidden layers.
        init_scale: initial posterior std of the weights (``None``: the layer's default,
            :math:`0.1/\sqrt{\text{fan\_in}}`).
        prior_variance: the initial prior variance of the layers' buffers.
    """

    hidden: list[int]
    activation: Activation = "relu"
    residual: bool = False
    init_scale: float | None = None
    prior_variance: float = 1.0

    def __post_init__(self) -> None:
        hidden: object = self.hidden
        check(
            isinstance(hidden, (list, tuple)) and all(is_int(h) and h >= 1 for h in hidden),
            f"hidden must be a list of positive ints, got {hidden!r}",
        )
        one_of("activation", self.activation, ("relu", "heaviside"))
        self.hidden = list(self.hidden)
        self.residual = bool(self.residual)
        if self.init_scale is not None:
            self.init_scale = positive_float("init_scale", self.init_scale)

    def build(self, in_features: int, out_features: int) -> nn.Module:
        """The MLP ``in_features -> hidden -> out_features``."""
        layer_kwargs: dict[str, Any] = {"prior_variance": self.prior_variance}
        if self.init_scale is not None:
            layer_kwargs["init_scale"] = self.init_scale
        return mlp(
            in_features, self.hidden, out_features, self.activation, self.residual, **layer_kwargs
        )


def check_net(net: object, in_features: int | None, out_features: int | None) -> BayesModule:
    """``net`` checked to be a declared network whose widths fit ``in_features``/``out_features``."""
    if not isinstance(net, BayesModule):
        raise ValueError(
            f"net must be a lightning_dvi.nn module (BayesModule), got {type(net).__name__}"
        )
    layers = list(bayes_layers(net))
    check(bool(layers), f"net {type(net).__name__} has no BayesLinear layer")
    first, last = layers[0], layers[-1]
    last_out = getattr(last, "out_features", None)  # a BayesConv2d has out_channels
    check(
        out_features is None or last_out == out_features,
        f"the injected net ends in {last_out} outputs but the likelihood needs {out_features}",
    )
    check(
        # a conv first layer checks its channels itself, on the first batch
        in_features is None
        or not isinstance(first, BayesLinear)
        or first.in_features == in_features,
        f"the injected net takes {getattr(first, 'in_features', None)} inputs but "
        f"in_features={in_features}",
    )
    return net


def setup_network(
    owner: str,
    net: nn.Module | Mapping[str, Any] | None,
    mlp: MLPConfig | None,
    in_features: int | None,
    out_features: int | None,
) -> tuple[nn.Module, int | None]:
    """The network of module ``owner`` and its input width.

    Either ``net``, an injected network or the ``{"class_path", "init_args"}`` configuration a
    CLI checkpoint saved of one, checked against the widths; or (``net=None``) the ``mlp``, built
    at once when both widths are known and otherwise an :class:`UnbuiltNetwork` until ``setup()``.
    """
    if mlp is not None:
        if in_features is None or out_features is None:
            return UnbuiltNetwork(owner), in_features
        return mlp.build(in_features, out_features), in_features
    if isinstance(net, Mapping):
        net = instantiate_net(net)
    net = check_net(net, in_features, out_features)
    # a convolutional first layer has channels, not an input width
    return net, getattr(next(iter(bayes_layers(net))), "in_features", None)


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
