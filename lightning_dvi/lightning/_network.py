"""The network of a DVI LightningModule: an injected one, or the built-in MLP.

The constructor's network arguments are resolved here, once: an injected network (checked
against the likelihood's width), one rebuilt from the configuration a CLI checkpoint saved, or
the MLP's architecture (:class:`MLPConfig`), built at once when both widths are known and
otherwise a placeholder until ``setup()`` reads the input width from the data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from torch import nn

from ..configurable import AllowList
from ..nn import BayesModule, bayes_layers, mlp
from ..nn.builders import Activation, activation_class
from ._validation import check, is_int, optional_positive_int, positive_float

__all__ = [
    "MLP_ARGUMENTS",
    "MLPConfig",
    "UnbuiltNetwork",
    "check_net",
    "check_net_config",
    "instantiate_net",
    "network_class",
    "primitive",
    "register_network",
    "setup_network",
]

_N = TypeVar("_N", bound=nn.Module)

# The constructor arguments that only describe the built-in MLP (not recorded with an injected net).
MLP_ARGUMENTS = ("hidden", "activation", "residual", "init_scale")


@dataclass
class MLPConfig:
    r"""The built-in MLP's architecture, checked on construction, built once the widths are known.

    Args:
        hidden: hidden-layer widths (positive ints; may be empty).
        activation: the name of a registered activation (``"relu"``, ``"gelu"``, ``"tanh"``, ...;
            :data:`~lightning_dvi.nn.builders.Activation`).
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
        activation_class(self.activation)  # a registered activation's name, or a ValueError
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
    last = layers[-1]
    last_out = getattr(last, "out_features", None)  # a BayesConv2d has out_channels
    check(
        out_features is None or last_out == out_features,
        f"the injected net ends in {last_out} outputs but the likelihood needs {out_features}",
    )
    first_in = _input_width(net)
    check(
        # a conv first layer (no in_features) checks its channels itself, on the first batch
        in_features is None or first_in is None or first_in == in_features,
        f"the injected net takes {first_in} inputs but in_features={in_features}",
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

    Raises:
        ValueError: for an ``in_features`` that is not ``None`` or a positive int, or a network
            that does not fit the widths.
    """
    optional_positive_int("in_features", in_features, " (read from the data)")
    if mlp is not None:
        if in_features is None or out_features is None:
            return UnbuiltNetwork(owner), in_features
        return mlp.build(in_features, out_features), in_features
    if isinstance(net, Mapping):
        net = instantiate_net(net, f"{owner}'s net configuration")
    net = check_net(net, in_features, out_features)
    return net, _input_width(net)


def _input_width(net: nn.Module) -> int | None:
    """The input width of a declared network, or ``None`` where it has none to check.

    The network's own ``in_features`` when it declares one (``None`` for a
    :class:`~lightning_dvi.nn.LastLayerNetwork`, whose torch backbone takes what it takes),
    else its first weight layer's (a convolutional first layer has channels, not a width).
    """
    if hasattr(net, "in_features"):
        width = net.in_features
        return width if isinstance(width, int) else None
    return getattr(next(iter(bayes_layers(net))), "in_features", None)


def register_network(cls: type[_N]) -> type[_N]:
    """Allow ``cls`` to be rebuilt from a checkpoint's or configuration's ``class_path``.

    A checkpoint is data: :func:`instantiate_net` builds only this library's network classes
    and the classes registered here, looked up by name in a table (it never imports a module
    or calls a callable the file names). Register your own :class:`~lightning_dvi.nn.BayesModule`
    subclass in the code that loads the checkpoint, before loading; it also works as a
    class decorator.

    Args:
        cls: a :class:`~lightning_dvi.nn.BayesModule` subclass whose constructor takes plain
            values (numbers, strings, booleans, ``None`` and lists or dicts of them).

    Returns:
        ``cls``, unchanged.

    Raises:
        ValueError: if ``cls`` is not a ``BayesModule`` subclass.

    Examples:
        >>> from lightning_dvi.nn import BayesLinear
        >>> @register_network
        ... class Wide(BayesLinear):
        ...     pass
        >>> type(instantiate_net({"class_path": f"{__name__}.Wide",
        ...                       "init_args": {"in_features": 1, "out_features": 2}})).__name__
        'Wide'
    """
    return _NETWORKS.register(cls)


def _library_networks() -> list[type[nn.Module]]:
    """This library's network classes (and registered activations)."""
    from .. import nn as dvi_nn
    from ..nn.convert import TorchFlatten

    classes: list[type[nn.Module]] = [
        TorchFlatten,
        *(spec.cls for spec in dvi_nn.layer_specs() if spec.cls is not None),
        *(
            obj
            for name in dvi_nn.__all__
            if isinstance(obj := getattr(dvi_nn, name), type)
            and issubclass(obj, BayesModule)
            and obj is not BayesModule
        ),
    ]
    return classes


_NETWORKS: AllowList[nn.Module] = AllowList(
    "network",
    BayesModule,
    _library_networks,
    ("lightning_dvi.nn", "lightning_dvi"),
    "register_network",
    refusal=(
        "refusing to build {class_path!r} named by {where}: a checkpoint is data, so only "
        "lightning_dvi's network classes and classes registered with "
        "lightning_dvi.lightning.register_network are rebuilt from it (nothing the file names "
        "is imported or called). To load weights you trust, build the network in code and "
        "load its state_dict: DVIRegressor.load_from_checkpoint(path, net=MyNet(...)), or "
        "net.load_state_dict(...)"
    ),
    base_name="lightning_dvi.nn.BayesModule",
)


def network_class(class_path: object, where: str = "the network configuration") -> type[nn.Module]:
    """The allowed network class named ``class_path``, looked up by name (nothing is imported).

    Raises:
        ValueError: naming ``class_path`` when it is not one of this library's network classes
            or a class registered with :func:`register_network`, and saying how to load trusted
            weights instead.
    """
    return _NETWORKS.lookup(class_path, where)


_PLAIN = (bool, int, float, str, type(None))


def _argument(value: Any, where: str, build: bool) -> Any:
    """``value`` checked to be plain data (or a nested allowed network configuration)."""
    if isinstance(value, _PLAIN):
        return value
    if isinstance(value, (list, tuple)):
        return [_argument(v, where, build) for v in value]
    if isinstance(value, Mapping):
        if "class_path" in value:
            return _build(value, where, build)
        if all(isinstance(k, str) for k in value):
            return {k: _argument(v, where, build) for k, v in value.items()}
    raise ValueError(
        f"refusing {where}: its arguments must be plain values (numbers, strings, booleans, "
        f"None, and lists or dicts of them), got a {type(value).__name__}"
    )


def _build(config: Mapping[str, Any], where: str, build: bool = True) -> Any:
    extra = set(config) - {"class_path", "init_args", "dict_kwargs"}
    if extra:
        raise ValueError(f"{where} has unexpected keys {sorted(extra)} next to class_path")
    cls = network_class(config["class_path"], where)
    arguments: dict[str, Any] = {}
    for key in ("init_args", "dict_kwargs"):
        given = config.get(key) or {}
        if not isinstance(given, Mapping):
            raise ValueError(f"{where}: {key} must be a mapping, got {type(given).__name__}")
        arguments.update(given)
    kwargs = {
        str(k): _argument(v, f"{where} ({cls.__name__}.{k})", build) for k, v in arguments.items()
    }
    if not build:
        return cls
    try:
        return cls(**kwargs)
    except TypeError as err:
        raise ValueError(f"{where}: cannot build {config['class_path']}: {err}") from err


def instantiate_net(
    config: Mapping[str, Any], where: str = "the network configuration"
) -> nn.Module:
    """Build a network from ``{"class_path": ..., "init_args": {...}}`` (how the CLI saves it).

    An allow-list loader: ``class_path`` must name one of this library's network classes or a
    class registered with :func:`register_network`, found by name in a table (no module is
    imported, no callable named by the configuration is called), and the arguments must be
    plain values; a nested ``class_path`` dictionary in ``init_args`` is built the same way.

    Args:
        config: the configuration, as a checkpoint's ``net`` hyper-parameter holds it.
        where: what the configuration came from, for the error messages.

    Raises:
        ValueError: without a ``class_path``, for a class path that is not allowed (naming it
            and how to load trusted weights instead), or for arguments that are not plain data.
    """
    if "class_path" not in config:
        raise ValueError(f"a network configuration needs a class_path, got keys {sorted(config)}")
    net: nn.Module = _build(config, where)
    return net


def check_net_config(config: object, where: str) -> None:
    """Check, without building anything, that :func:`instantiate_net` would accept ``config``.

    ``None`` and a network object pass; a mapping is checked like :func:`instantiate_net`
    checks it (allowed class paths, plain arguments).

    Raises:
        ValueError: as :func:`instantiate_net`.
    """
    if isinstance(config, Mapping):
        if "class_path" not in config:
            raise ValueError(f"{where} needs a class_path, got keys {sorted(config)}")
        _build(config, where, build=False)


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
