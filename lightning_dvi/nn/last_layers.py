r"""Last-layer (and last-:math:`k`-layer) DVI on a trained torch network.

``from_torch(model, last_layers=k)`` traces ``model`` with ``torch.fx``, finds its weight
layers (``call_module`` nodes whose module is a registered weight kind: ``nn.Linear``,
``nn.Conv2d``, ...) in topological order, and cuts the graph before the first of the last
:math:`k`:

* the **backbone** is every node that the rest needs and that does not depend on one of those
  :math:`k` layers. It stays *plain torch* (a :class:`torch.fx.GraphModule` over a copy of the
  model's submodules), runs on tensors with point weights and carries no covariance, so it
  costs what it costs in torch. It is frozen by default (``requires_grad=False``, and kept in eval mode while
  the network trains, so BatchNorm's running statistics do not move); ``freeze_backbone=False``
  fine-tunes it by maximum likelihood inside the ELBO.
* the **head** (everything that depends on a Bayesian layer) is converted to declared DVI
  modules, its posterior initialised from the trained weights (``init="torch"``).

The values that cross the cut (the *live values*) are the backbone's outputs and the head's
inputs. The head goes through the graph converter (:mod:`lightning_dvi.nn.trace`): a chain
(one live value, then one node after another: ``fc`` of a ResNet; the last layers of an MLP)
becomes a :class:`~lightning_dvi.nn.Sequential` (or its one layer), anything else a
:class:`~lightning_dvi.nn.GraphNetwork`. A cut inside a residual block (``k = 2`` on
ResNet-18: the block's input feeds the skip connection, the first convolution's activation
feeds the second convolution) leaves several live values: the backbone returns them all, as
a tuple, and the head is a graph of several inputs. They are tensors, hence deterministic: zero
variance and zero covariance with each other and with the Bayesian layers' outputs, so a sum
``branch + skip`` adds the skip's value to the branch's mean and nothing to its variance, which
is exact (the skip is a function of :math:`x` alone, the branch's randomness is the head's
weights).

Why the head's output is exact for ``k = 1`` with a Linear head: its input :math:`h` is a
deterministic function of :math:`x`, so :math:`a = hW^\top + b` is a linear map of the Gaussian
weights, Gaussian with :math:`E[a] = hM^\top + c`, :math:`\operatorname{Var}(a) = h^2V^\top + u`
(one extra matrix product), independent across classes under the factorised posterior and
correlated under ``head_covariance="full"`` (:class:`~lightning_dvi.nn.BayesLinearFullCov`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from torch import Tensor, fx, nn

from ..gaussian import Gaussian
from ..propagation import FULL, Mode, Propagation, propagation
from .base import BayesModule, Moments, finish, prepare_input
from .container import Sequential
from .full_cov import BayesLinearFullCov
from .graph import GraphNetwork
from .linear import BayesLinear
from .registry import ConversionOptions, register_layer, spec_for_module
from .trace import graph_from_torch

__all__ = [
    "Cut",
    "HeadCovariance",
    "LastLayerNetwork",
    "convert_head",
    "last_layer_network",
    "split",
]

HeadCovariance = Literal["diag", "full"]


@dataclass(frozen=True)
class Cut:
    """A traced network cut before its last ``k`` weight layers (:func:`split`).

    Attributes:
        backbone: the plain-torch part; returns the live value (or a tuple of them).
        head: the rest, as a graph module whose inputs are the live values, in order.
        live: the names of the live values (graph node names, e.g. ``"flatten"``).
        bayesian: the qualified names of the weight layers that become Bayesian.
    """

    backbone: fx.GraphModule
    head: fx.GraphModule
    live: tuple[str, ...]
    bayesian: tuple[str, ...]


def _is_weight_layer(module: nn.Module) -> bool:
    spec = spec_for_module(module)
    return spec is not None and spec.kind == "weight"


def split(model: nn.Module, last_layers: int) -> Cut:
    """Trace ``model`` and cut it before its last ``last_layers`` weight layers.

    Raises:
        NotImplementedError: if ``torch.fx`` cannot trace ``model`` (data-dependent control
            flow), or the network's output is not one tensor computed by the head.
        ValueError: if ``last_layers`` is not a positive int, or exceeds the number of weight
            layers.
    """
    if isinstance(last_layers, bool) or not isinstance(last_layers, int) or last_layers < 1:
        raise ValueError(f"last_layers must be a positive int, got {last_layers!r}")
    try:
        traced = fx.symbolic_trace(copy.deepcopy(model))  # the caller's model stays untouched
    except Exception as err:  # torch.fx raises TraceError, TypeError, ... on untraceable code
        raise NotImplementedError(
            f"from_torch(last_layers={last_layers}): torch.fx cannot trace "
            f"{type(model).__name__} ({type(err).__name__}: {err}); make its forward free of "
            "data-dependent control flow"
        ) from err
    nodes = list(traced.graph.nodes)
    weights = [
        n for n in nodes
        if n.op == "call_module" and _is_weight_layer(traced.get_submodule(str(n.target)))
    ]  # fmt: skip
    if last_layers > len(weights):
        raise ValueError(
            f"last_layers={last_layers} but {type(model).__name__} has {len(weights)} weight "
            f"layers ({', '.join(str(n.target) for n in weights) or 'none'})"
        )
    bayesian = set(weights[-last_layers:])
    head_nodes: set[fx.Node] = set()
    for node in nodes:  # topological order: inputs come first
        if node in bayesian or any(a in head_nodes for a in node.all_input_nodes):
            head_nodes.add(node)
    for node in nodes:  # a parameter or buffer read only by the head (a positional table)
        if node.op == "get_attr" and node.users and all(u in head_nodes for u in node.users):
            head_nodes.add(node)
    output = nodes[-1]
    result = output.args[0]
    if not isinstance(result, fx.Node) or result not in head_nodes:
        raise NotImplementedError(
            f"from_torch(last_layers=...): the output of {type(model).__name__} must be one "
            f"tensor computed by its head, got {result!r}"
        )
    live = [
        n for n in nodes
        if n not in head_nodes and any(u in head_nodes and u is not output for u in n.users)
    ]  # fmt: skip
    return Cut(
        _backbone(traced, nodes, head_nodes, live),
        _head(traced, nodes, head_nodes, live, result),
        tuple(n.name for n in live),
        tuple(str(n.target) for n in weights[-last_layers:]),
    )


def _backbone(
    traced: fx.GraphModule, nodes: list[fx.Node], head: set[fx.Node], live: list[fx.Node]
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if node not in head and node.op != "output":
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[live[0]] if len(live) == 1 else tuple(env[n] for n in live))
    backbone = fx.GraphModule(traced, graph, class_name="Backbone")
    backbone.graph.eliminate_dead_code()
    backbone.recompile()
    return backbone


def _head(
    traced: fx.GraphModule,
    nodes: list[fx.Node],
    head: set[fx.Node],
    live: list[fx.Node],
    result: fx.Node,
) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {n: graph.placeholder(n.name) for n in live}
    for node in nodes:
        if node in head:
            env[node] = graph.node_copy(node, lambda a: env[a])
    graph.output(env[result])
    return fx.GraphModule(traced, graph, class_name="Head")


def convert_head(head: fx.GraphModule, options: ConversionOptions) -> BayesModule:
    """The head as declared modules, by the graph converter (:mod:`lightning_dvi.nn.trace`).

    A chain (one input, each node applying one layer or function to the previous value: ``fc``
    of a ResNet, the last layers of an MLP) becomes a :class:`Sequential`, or its one layer
    (``last_layers=1`` on a Linear output layer gives a :class:`BayesLinear`); anything else (a
    residual block before the output layer, a head of several inputs) a
    :class:`~lightning_dvi.nn.GraphNetwork`, whose inputs are the live values in order.

    Raises:
        NotImplementedError: for a node the graph converter does not support.
        ValueError: for a head with nothing to convert.
    """
    converted = graph_from_torch(head, options, several_inputs=True, chain="sequential")
    if isinstance(converted, Sequential) and len(converted) == 1:
        only = converted[0]
        assert isinstance(only, BayesModule)  # built by the graph converter
        return only
    return converted


def _full_covariance(head: BayesModule) -> BayesModule:
    """``head`` with its output layer, a :class:`BayesLinear`, made a :class:`BayesLinearFullCov`.

    Only the output layer: its :math:`P = K(D+1)` is small (650 for ten classes on 64
    features), while an inner layer's is not (4,112 for ``Linear(256, 16)``, whose
    :math:`O(P^3)` covariance took most of a minute per epoch on digits).
    """
    if isinstance(head, BayesLinear):
        return BayesLinearFullCov.from_bayes_linear(head)
    if isinstance(head, GraphNetwork):
        return _graph_full_covariance(head)
    named = [(n, m) for n, m in head.named_modules() if isinstance(m, BayesLinear)]
    last = [m for m in head.modules() if isinstance(m, BayesModule) and m is not head]
    if not named or not any(m is named[-1][1] for m in last[-1:]):
        raise ValueError(
            "head_covariance='full' needs a head that ends in a Linear layer, got "
            f"{type(last[-1]).__name__ if last else type(head).__name__}"
        )
    path, layer = named[-1]
    parent = head.get_submodule(path.rpartition(".")[0])
    setattr(parent, path.rpartition(".")[2], BayesLinearFullCov.from_bayes_linear(layer))
    return head


def _graph_full_covariance(head: GraphNetwork) -> GraphNetwork:
    by_name = {n["name"]: n for n in head.nodes}
    node = by_name[head.nodes[-1]["inputs"][0]]
    layer = head.layers[node["module"]] if node["op"] == "call" else None
    if not isinstance(layer, BayesLinear):
        raise ValueError(
            "head_covariance='full' needs a head that ends in a Linear layer, got "
            f"{type(layer).__name__ if layer is not None else node['op']!r}"
        )
    head.layers[node["module"]] = BayesLinearFullCov.from_bayes_linear(layer)
    head.module_table[node["module"]] = {
        "kind": "linear_full_cov",
        "unstorable": "a full-covariance head is built by from_torch(head_covariance='full')",
    }
    return head


def last_layer_network(
    model: nn.Module,
    last_layers: int,
    options: ConversionOptions,
    freeze_backbone: bool = True,
    head_covariance: HeadCovariance = "diag",
) -> LastLayerNetwork:
    """:func:`split` ``model``, convert the head with ``convert``, and package both.

    What ``from_torch(model, last_layers=k, ...)`` calls (see :mod:`this module
    <lightning_dvi.nn.last_layers>`). The backbone is a copy of the model's modules (freezing or
    fine-tuning it leaves ``model`` as it was); the head's posterior is initialised as
    ``options`` say (``from_torch``'s ``init``, ``scale_fraction``, ...).

    Raises:
        ValueError: for a ``head_covariance`` other than ``"diag"`` or ``"full"``, and as
            :func:`split` and :func:`convert_head`.
    """
    if head_covariance not in ("diag", "full"):
        raise ValueError(f"head_covariance must be 'diag' or 'full', got {head_covariance!r}")
    if not isinstance(freeze_backbone, bool):
        raise ValueError(f"freeze_backbone must be True or False, got {freeze_backbone!r}")
    cut = split(model, last_layers)
    head = convert_head(cut.head, options)
    if head_covariance == "full":
        head = _full_covariance(head)
    return LastLayerNetwork(cut.backbone, head, freeze_backbone=freeze_backbone)


@register_layer("last_layers", kind="container")
class LastLayerNetwork(BayesModule):
    """A plain-torch backbone followed by a declared (Bayesian) head; runs in all four modes.

    The backbone maps the input tensor to features (point weights, no covariance); the head
    propagates them: moments in ``full``/``diag`` mode, samples in ``sample``/``local`` mode,
    where the backbone runs **once** for all samples (``net(x, mode="sample", num_samples=S)``).
    Built by ``from_torch(model, last_layers=k)``; the constructor takes any torch module as
    the backbone.

    Args:
        backbone: a torch module ``x -> features`` (a tensor in; a tensor out, or a tuple of
            tensors for a head of several inputs, a :class:`~lightning_dvi.nn.GraphNetwork`).
        head: the declared head.
        freeze_backbone: ``True`` (default): the backbone's parameters get
            ``requires_grad=False`` and the backbone stays in eval mode when the network is put
            in training mode (BatchNorm uses and keeps its running statistics); ``False``:
            it trains with the head (point estimates: it adds nothing to the KL).

    Saving and loading: the backbone is user code, so a checkpoint stores only its tensors
    (state-dict entries ``backbone.*``); load by building the same network in code and passing
    it, ``DVIClassifier.load_from_checkpoint(path, net=from_torch(model, last_layers=1))``.
    """

    in_features = None  # the backbone takes whatever the torch model took
    image_output = False

    def __init__(
        self, backbone: nn.Module, head: BayesModule, freeze_backbone: bool = True
    ) -> None:
        super().__init__()
        if not isinstance(backbone, nn.Module) or isinstance(backbone, BayesModule):
            raise TypeError(f"backbone must be a plain torch module, got {type(backbone).__name__}")
        if not isinstance(head, BayesModule):
            raise TypeError(f"head must be a lightning_dvi.nn module, got {type(head).__name__}")
        self.backbone = backbone
        self.head = head
        self.freeze_backbone = bool(freeze_backbone)
        if self.freeze_backbone:
            backbone.requires_grad_(False)
            backbone.eval()

    @property
    def out_features(self) -> int | None:
        """The width of the head's last weight layer."""
        last = [m for m in self.head.modules() if hasattr(m, "out_features")]
        return getattr(last[-1], "out_features", None) if last else None

    def train(self, mode: bool = True) -> LastLayerNetwork:
        """Set training mode; a frozen backbone stays in eval mode."""
        super().train(mode)
        if self.freeze_backbone:
            self.backbone.train(False)
        return self

    def features(self, x: Tensor) -> Tensor | tuple[Tensor, ...]:
        """The backbone's output for a tensor input ``[B, ...]``: one tensor, or a tuple.

        Raises:
            TypeError: for a backbone output that is neither, or a tuple for a head that is
                not a graph of that many inputs.
        """
        out = self.backbone(x)
        if isinstance(out, Tensor):
            return out
        inputs = self.head.num_inputs if isinstance(self.head, GraphNetwork) else 1
        if not isinstance(out, tuple) or not all(isinstance(t, Tensor) for t in out):
            raise TypeError(
                f"the backbone must return a tensor or a tuple of tensors, got {type(out).__name__}"
            )
        if len(out) != inputs:
            raise TypeError(f"the backbone returned {len(out)} tensors; the head takes {inputs}")
        return out

    def _head(self, feats: Tensor | tuple[Tensor, ...], mode: Propagation) -> Moments:
        if isinstance(feats, tuple):
            assert isinstance(self.head, GraphNetwork)  # features() checked it
            return self.head.propagate(feats, mode)
        return self.head.propagate(feats, mode)

    def forward(
        self, x: Moments, mode: Mode | Propagation = "full", num_samples: int | None = None
    ) -> Moments:
        """As :meth:`BayesModule.forward`; the Monte Carlo modes run the backbone once."""
        how = propagation(mode, num_samples)
        if how.samples and isinstance(x, Tensor):
            prepare_input(x, FULL, integer_ok=True)  # checks only: finite, any dtype
            # the head expands the features (a tuple of them for a graph head) to [S, B, ...]
            out: Tensor = self.head(self.features(x), mode=how)
            return out
        # the backbone is plain torch: it takes what the torch model took, integer token ids
        # included (only the head needs floating features)
        moments = self.propagate(prepare_input(x, how, integer_ok=True), how)
        return finish(moments, how, self)

    def propagate(self, x: Moments, mode: Propagation) -> Moments:
        """The head's moments (or samples) at the backbone's features."""
        if isinstance(x, Gaussian):
            raise ValueError(
                "LastLayerNetwork: the backbone is plain torch and needs a tensor input, "
                "got a Gaussian"
            )
        if mode.samples:  # x [S, B, ...] from an enclosing module
            feats = self.features(x.flatten(0, 1))
            return self._head(_each(feats, lambda t: t.unflatten(0, x.shape[:2])), mode)
        return self._head(self.features(x), mode)

    def extra_repr(self) -> str:
        """Whether the backbone is frozen."""
        return f"freeze_backbone={self.freeze_backbone}"


def _each(
    feats: Tensor | tuple[Tensor, ...], fn: Callable[[Tensor], Tensor]
) -> Tensor | tuple[Tensor, ...]:
    return fn(feats) if isinstance(feats, Tensor) else tuple(fn(t) for t in feats)
