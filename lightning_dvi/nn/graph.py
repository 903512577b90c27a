r"""Graph networks: declared modules wired as a DAG, run in all four modes.

What :func:`~lightning_dvi.nn.from_torch` builds from a ``torch.fx`` trace.

A :class:`GraphNetwork` is plain data plus weights: a node list (``input``, ``call`` of a module,
``add``, ``cat``, ``output``, each naming its inputs) and a table of its modules, each stored as
a registry kind with the torch layer's constructor arguments (or the arguments of the torch
function call it came from). Nothing is pickled or generated: the same data rebuilds the same
modules, so a checkpoint needs no torch file and no code (:meth:`GraphNetwork.architecture`).

**Sums with cross-covariances.** For :math:`u = a + b` the moments are

.. math::
    E[u] = E[a] + E[b],\qquad
    \operatorname{Cov}(u) = \operatorname{Cov}(a) + \operatorname{Cov}(b) + X + X^\top,
    \qquad X = \operatorname{Cov}(a, b).

When :math:`a` and :math:`b` descend from a common value :math:`x` (a skip connection,
``branch(x) + x`` or ``branch(x) + shortcut(x)``), :math:`X \neq 0`. For flat values ``[B, D]``
the walk carries :math:`\operatorname{Cov}(w, v)` for every pair of live values that share an
ancestor, through every module by its ``propagate_cross`` rule (exact through affine maps, Stein's
lemma :math:`\operatorname{Cov}(w, f(v)) = \operatorname{Cov}(w, v)\,E[f'(v)]` through elementwise
activations; :mod:`lightning_dvi.moments.residual`), starting from
:math:`\operatorname{Cov}(x, x) = \operatorname{Cov}(x)` at a fork. This is the
:class:`~lightning_dvi.nn.Residual` rule generalised to any DAG; in ``diag`` mode only the
diagonal of :math:`X` is used, as :class:`~lightning_dvi.nn.Residual` does.

For **images** (``[B, C, H, W]`` moments, which convolutional stages keep per pixel in both
moment modes) an image cross-covariance ``[CHW, CHW]`` is not formed: the two operands of a sum
are treated as **independent** (cuTAGI's rule for ResNet blocks), :math:`X = 0`. The error this
makes on a ResNet BasicBlock is measured against Monte Carlo in docs/moments.md. A full-mode
``torch.cat`` of two correlated flat values whose cross-covariance could not be carried is
refused rather than approximated, and so is a full-mode sum whose cross-covariance was lost at a
module without a cross-covariance rule.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from .. import moments as M
from ..gaussian import Gaussian
from ..propagation import Mode, Propagation, propagation
from .base import BayesModule, Moments, finish, prepare_input
from .registry import ConversionOptions, LayerSpec, layer_specs, register_layer
from .torch_layers import build_layer, plain

__all__ = ["GraphNetwork", "build_node_module"]

_OPS = ("input", "call", "add", "cat", "output")


def _spec(kind: object, where: str) -> LayerSpec:
    for spec in layer_specs():
        if spec.name == kind:
            return spec
    raise ValueError(f"{where}: unknown layer kind {kind!r} (not in the layer registry)")


def build_node_module(
    description: Mapping[str, Any], where: str, layer_kwargs: Mapping[str, Any] | None = None
) -> BayesModule:
    """The declared module a graph's module entry describes (fresh posterior; weights load after).

    Args:
        description: ``{"kind": registry name, "torch": torch layer entry}`` (a torch module,
            rebuilt by name from the registry's table and converted with ``init="fresh"``) or
            ``{"kind": ..., "args": [...], "kwargs": {...}}`` (a torch function call's extra
            arguments, e.g. ``F.leaky_relu(x, 0.2)``).
        where: a name for error messages.
        layer_kwargs: forwarded to the weight layers' converters, as in ``from_torch``.

    A ``"rules"`` entry (:func:`lightning_dvi.nn.rules.module_rules`, which
    :meth:`GraphNetwork.architecture` records) sets the moment rules of the built module and its
    submodules; a description without one builds the modules' defaults.

    Raises:
        ValueError: for an unknown kind, a torch type the kind does not stand for, a
            description that is not plain data, or rules the module does not have.
    """
    if not isinstance(description, Mapping) or "kind" not in description:
        raise ValueError(f"{where}: expected a mapping with a 'kind', got {description!r}")
    spec = _spec(description["kind"], where)
    if "unstorable" in description:
        raise ValueError(f"{where}: {description['unstorable']}")
    module = _build_node_module(description, spec, where, layer_kwargs)
    if "rules" in description:
        from .rules import apply_rules

        apply_rules(module, description["rules"], where)
    return module


def _build_node_module(
    description: Mapping[str, Any],
    spec: LayerSpec,
    where: str,
    layer_kwargs: Mapping[str, Any] | None,
) -> BayesModule:
    if "torch" in description:
        torch_module = build_layer(description["torch"], where)
        if type(torch_module) not in spec.torch_modules:
            raise ValueError(
                f"{where}: layer kind {spec.name!r} does not stand for "
                f"{type(torch_module).__name__}"
            )
        options = ConversionOptions("fresh", 0.0, 1e-8, dict(layer_kwargs or {}))
        built = spec.convert_module(torch_module, options)
        if built is None:
            raise ValueError(f"{where}: {type(torch_module).__name__} converts to nothing")
        return built
    args = [plain(a, f"{where}.args") for a in description.get("args", [])]
    kwargs = {str(k): plain(v, f"{where}.{k}") for k, v in description.get("kwargs", {}).items()}
    try:
        return spec.build_from_call(*args, **kwargs)
    except (NotImplementedError, TypeError) as err:
        raise ValueError(f"{where}: cannot build {spec.name}: {err}") from err


def _check_nodes(nodes: Sequence[Mapping[str, Any]], modules: Mapping[str, Any]) -> None:
    seen: set[str] = set()
    num_inputs = max(next((i for i, n in enumerate(nodes) if not _is_input(n)), len(nodes)), 1)
    for i, node in enumerate(nodes):
        where = f"nodes[{i}]"
        if not isinstance(node, Mapping) or node.get("op") not in _OPS or "name" not in node:
            raise ValueError(f"{where}: expected {{'name', 'op' in {_OPS}, ...}}, got {node!r}")
        name, op, inputs = str(node["name"]), node["op"], list(node.get("inputs", []))
        if name in seen:
            raise ValueError(f"{where}: node name {name!r} is used twice")
        if (op == "input") != (i < num_inputs) or (op == "output") != (i == len(nodes) - 1):
            raise ValueError(
                "a graph starts with its 'input' nodes (at least one) and ends with 'output'"
            )
        for value in inputs:
            if isinstance(value, str) and value not in seen:
                raise ValueError(f"{where} ({name}): input {value!r} is not an earlier node")
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError(f"{where} ({name}): input {value!r} is not a node or a number")
        named = [v for v in inputs if isinstance(v, str)]
        wanted = {"input": 0, "call": 1, "output": 1}.get(op)
        if (wanted is not None and (len(named) != wanted or len(inputs) != wanted)) or (
            op == "add" and (len(inputs) != 2 or not named)
        ):
            raise ValueError(f"{where} ({name}): wrong inputs {inputs!r} for op {op!r}")
        if op == "cat" and (len(named) != len(inputs) or not isinstance(node.get("dim"), int)):
            raise ValueError(f"{where} ({name}): cat needs node inputs and an int 'dim'")
        if op == "call" and node.get("module") not in modules:
            raise ValueError(f"{where} ({name}): module {node.get('module')!r} is not in modules")
        seen.add(name)


def _is_input(node: Any) -> bool:
    return isinstance(node, Mapping) and node.get("op") == "input"


@register_layer("graph", kind="container")
class GraphNetwork(BayesModule):
    """Declared modules wired as a DAG, stored as plain data (see the module docstring).

    Built by :func:`~lightning_dvi.nn.from_torch` for any module ``torch.fx`` traces; rebuilt
    from :meth:`architecture` (plain data) by a checkpoint, then loaded with the trained weights.

    Args:
        nodes: the node list, in execution order: ``{"name", "op": "input"}`` first (one per
            input: a graph of several inputs is called with a tuple of them), then
            ``{"name", "op": "call", "module": key, "inputs": [node]}``,
            ``{"name", "op": "add", "inputs": [node, node or number]}``,
            ``{"name", "op": "cat", "dim": int, "inputs": [node, ...]}``, and
            ``{"name", "op": "output", "inputs": [node]}`` last.
        modules: ``key -> description`` (:func:`build_node_module`); a key may be called by
            several nodes (a parameter-free module used twice, like torchvision's ``self.relu``).
        layer_kwargs: forwarded to the weight layers' converters when building from data.
        built: the modules themselves, keyed as ``modules`` (how ``from_torch`` hands over the
            converted layers with the torch weights); ``None`` builds them from ``modules``.

    Raises:
        ValueError: for a malformed node list or module table.
    """

    def __init__(
        self,
        nodes: Sequence[Mapping[str, Any]],
        modules: Mapping[str, Mapping[str, Any]],
        layer_kwargs: Mapping[str, Any] | None = None,
        *,
        built: Mapping[str, BayesModule] | None = None,
    ) -> None:
        super().__init__()
        _check_nodes(nodes, modules)
        self.nodes: list[dict[str, Any]] = [dict(n) for n in nodes]
        self.module_table: dict[str, dict[str, Any]] = {k: dict(v) for k, v in modules.items()}
        self.layer_kwargs: dict[str, Any] = dict(layer_kwargs or {})
        self.layers = nn.ModuleDict(
            {
                key: built[key]
                if built is not None
                else build_node_module(desc, f"modules[{key!r}]", self.layer_kwargs)
                for key, desc in self.module_table.items()
            }
        )
        self._uses = Counter(
            v for n in self.nodes for v in n.get("inputs", []) if isinstance(v, str)
        )

    def architecture(self) -> dict[str, Any]:
        """``init_args`` that rebuild this network's architecture (plain data, no weights).

        ``GraphNetwork(**net.architecture())`` followed by ``load_state_dict`` gives back the
        network; a checkpoint stores this as its network configuration. Each module's entry
        carries the moment rules its modules have now (``"rules"``,
        :mod:`lightning_dvi.nn.rules`), so a network whose rules were changed after conversion
        (:func:`~lightning_dvi.nn.posthoc.set_rules`) comes back computing the same moments.

        Raises:
            ValueError: when a module could not be described as data (naming it).
        """
        for key, desc in self.module_table.items():
            if "unstorable" in desc:
                raise ValueError(f"module {key!r} cannot be stored as data: {desc['unstorable']}")
        from .rules import module_rules

        modules: dict[str, dict[str, Any]] = {}
        for key, desc in self.module_table.items():
            modules[key] = {k: v for k, v in desc.items() if k != "rules"}
            rules = module_rules(self._layer(key))
            if rules:  # the rules as they are now (set_rules may have changed them)
                modules[key]["rules"] = rules
        return {
            "nodes": [dict(n) for n in self.nodes],
            "modules": modules,
            "layer_kwargs": {
                str(k): plain(v, f"layer_kwargs.{k}") for k, v in self.layer_kwargs.items()
            },
        }

    @property
    def image_output(self) -> bool | None:
        """Whether the output is per-pixel: the last module on the output's path says."""
        by_name = {n["name"]: n for n in self.nodes}
        node = by_name[self.nodes[-1]["inputs"][0]]
        while node["op"] != "input":
            if node["op"] == "call":
                image = self._layer(node["module"]).image_output
                if image is not None:
                    return image
            node = by_name[next(v for v in node["inputs"] if isinstance(v, str))]
        return False

    @property
    def accepts_integer_input(self) -> bool:  # type: ignore[override]  # a property here
        """Whether an input node feeds a layer that takes integer ids (an embedding table)."""
        inputs = {n["name"] for n in self.nodes if n["op"] == "input"}
        return any(
            n["op"] == "call"
            and n["inputs"][0] in inputs
            and self._layer(n["module"]).accepts_integer_input
            for n in self.nodes
        )

    def _layer(self, key: str) -> BayesModule:
        layer = self.layers[key]
        assert isinstance(layer, BayesModule)  # built from the registry's declared kinds
        return layer

    @property
    def num_inputs(self) -> int:
        """How many values the graph takes (its ``input`` nodes); several come as a tuple."""
        return sum(1 for n in self.nodes if n["op"] == "input")

    def forward(
        self,
        x: Moments | Sequence[Moments],
        mode: Mode | Propagation = "full",
        num_samples: int | None = None,
    ) -> Moments:
        """As :meth:`BayesModule.forward`; a graph of several inputs takes a tuple of them.

        Each input is checked (and, in the Monte Carlo modes, expanded to ``[S, ...]``) as a
        single input is; tensors among them are deterministic: zero variance and zero
        covariance with every other value.

        Raises:
            ValueError: as :meth:`BayesModule.forward`, and for a number of inputs other than
                :attr:`num_inputs`.
        """
        if isinstance(x, (Tensor, Gaussian)):
            return super().forward(x, mode, num_samples)
        how = propagation(mode, num_samples)
        values = self._inputs(x)
        integer_ok = self.accepts_integer_input
        out = self.propagate([prepare_input(v, how, integer_ok) for v in values], how)
        return finish(out, how, self)

    def _inputs(self, x: Moments | Sequence[Moments]) -> list[Moments]:
        values = [x] if isinstance(x, (Tensor, Gaussian)) else list(x)
        if len(values) != self.num_inputs:
            raise ValueError(
                f"GraphNetwork: the graph takes {self.num_inputs} input(s) "
                f"({', '.join(n['name'] for n in self.nodes[: self.num_inputs])}), "
                f"got {len(values)}; pass several as a tuple"
            )
        return values

    def propagate(self, x: Moments | Sequence[Moments], mode: Propagation) -> Moments:
        """Run the nodes in order (moments with their cross-covariances, or samples)."""
        return _Walk(self, mode).run(self._inputs(x))

    def extra_repr(self) -> str:
        """The node count for ``repr``."""
        return f"nodes={len(self.nodes)}"


_LOST = object()  # a cross-covariance between correlated values that was not carried


def _flat(value: Moments) -> bool:
    return isinstance(value, Gaussian) and (value.cov is not None or value.mean.dim() == 2)


def _zero_cross(w: Moments, v: Moments) -> Tensor:
    """A zero ``Cov(w, v)`` ``[..., D_w, D_v]`` for independent flat values (or constants)."""
    mw = w.mean if isinstance(w, Gaussian) else w
    mv = v.mean if isinstance(v, Gaussian) else v
    return mw.new_zeros(*mv.shape[:-1], mw.shape[-1], mv.shape[-1])


def _cat_blocks(blocks: Sequence[Tensor], dim: int) -> Tensor:
    """Concatenate cross-covariance blocks along ``dim``, broadcasting their batch dimensions."""
    batch = torch.broadcast_shapes(*(b.shape[:-2] for b in blocks))
    return torch.cat([b.expand(*batch, *b.shape[-2:]) for b in blocks], dim)


class _Walk:
    r"""One propagation through a :class:`GraphNetwork`: values, ancestors and cross-covariances.

    ``anc[v]`` is the set of random nodes ``v`` depends on (two values with disjoint sets are
    independent); ``cross[(w, v)]`` is :math:`\\operatorname{Cov}(w, v)` ``[..., D_w, D_v]``,
    kept for flat Gaussians while both are live; ``failed[u]`` says why node ``u`` could not
    carry a cross-covariance.
    """

    def __init__(self, net: GraphNetwork, mode: Propagation) -> None:
        self.net, self.mode = net, mode
        self.values: dict[str, Moments] = {}
        self.anc: dict[str, frozenset[str]] = {}
        self.cross: dict[tuple[str, str], Tensor] = {}
        self.failed: dict[str, str] = {}
        self.uses = Counter(net._uses)

    def run(self, xs: Sequence[Moments]) -> Moments:
        feed = iter(xs)
        for node in self.net.nodes:
            name, op = node["name"], node["op"]
            inputs = node.get("inputs", [])
            if op == "input":  # a tensor is deterministic: no ancestor, independent of all
                x = next(feed)
                self._set(name, x, frozenset({name}) if isinstance(x, Gaussian) else frozenset())
            elif op == "output":
                return self.values[inputs[0]]
            elif op == "call":
                self._call(name, self.net._layer(node["module"]), inputs[0])
            elif op == "add":
                self._add(name, inputs[0], inputs[1])
            else:
                self._cat(name, inputs, int(node["dim"]))
            for v in inputs:
                if isinstance(v, str):
                    self._release(v)
        raise ValueError("the graph has no output node")  # pragma: no cover - _check_nodes

    # ------------------------------------------------------------------ bookkeeping
    def _set(self, name: str, value: Moments, anc: frozenset[str]) -> None:
        self.values[name] = value
        self.anc[name] = anc | {name} if isinstance(value, Gaussian) else anc

    def _release(self, name: str) -> None:
        self.uses[name] -= 1
        if self.uses[name] <= 0:
            self.values.pop(name, None)
            for pair in [p for p in self.cross if name in p]:
                del self.cross[pair]

    def _get(self, w: str, v: str) -> Any:
        """``Cov(w, v)``, ``None`` when independent, ``_LOST`` when correlated but not carried."""
        if w == v:
            value = self.values[v]
            return M.skip_covariance(value) if _flat(value) else _LOST  # type: ignore[arg-type]  # _flat: a Gaussian
        if (w, v) in self.cross:
            return self.cross[(w, v)]
        if (v, w) in self.cross:
            return self.cross[(v, w)].transpose(-1, -2)
        return None if not (self.anc[w] & self.anc[v]) else _LOST

    def _live(self, exclude: str) -> list[str]:
        """Flat Gaussian values still needed after the current node (``exclude``: its output)."""
        return [
            w for w, value in self.values.items() if w != exclude and _flat(value) and self.uses[w]
        ]

    def _remaining(self, w: str, inputs: Sequence[Any]) -> bool:
        """Whether ``w`` is still needed once the current node has consumed its inputs."""
        return self.uses[w] > sum(1 for v in inputs if v == w)

    # ------------------------------------------------------------------ ops
    def _call(self, name: str, layer: BayesModule, v: str) -> None:
        x = self.values[v]
        if self.mode.samples or not isinstance(x, Gaussian) or not _flat(x):
            self._set(name, layer.propagate(x, self.mode), self.anc[v])
            return
        rows = []  # no walrus in a comprehension: its cell variable breaks torch.compile's trace
        for w in self._live(name):
            if w != v or self._remaining(v, [v]):
                c = self._get(w, v)
                if isinstance(c, Tensor):
                    rows.append((w, c))
        if not rows:
            self._set(name, layer.propagate(x, self.mode), self.anc[v])
            return
        stacked = _cat_blocks([c for _, c in rows], -2)
        try:
            out_cross, out = layer.propagate_with_cross(stacked, x, self.mode)
        except NotImplementedError as err:
            self.failed[name] = f"{type(layer).__name__}: {err}"
            self._set(name, layer.propagate(x, self.mode), self.anc[v])
            return
        self._set(name, out, self.anc[v])
        if _flat(out):
            start = 0
            for w, c in rows:
                self.cross[(w, name)] = out_cross[..., start : start + c.shape[-2], :]
                start += c.shape[-2]

    def _combined_cross(self, name: str, operands: Sequence[str], cat: bool) -> None:
        """``Cov(w, u)`` for every live ``w``, from the operands' crosses.

        The sum (add) or concatenation (cat) of ``Cov(w, operand)``; an independent operand
        contributes a zero block.
        """
        out = self.values[name]
        if not _flat(out):
            return
        for w in self._live(name):
            if w in operands and not self._remaining(w, operands):
                continue
            parts = [self._get(w, v) for v in operands]
            if any(p is _LOST for p in parts) or all(p is None for p in parts):
                continue
            if cat:
                blocks = [
                    p if p is not None else _zero_cross(self.values[w], self.values[v])
                    for p, v in zip(parts, operands, strict=True)
                ]
                self.cross[(w, name)] = _cat_blocks(blocks, -1)
            else:
                terms = [p for p in parts if isinstance(p, Tensor)]
                self.cross[(w, name)] = terms[0] if len(terms) == 1 else terms[0] + terms[1]

    def _refuse_lost(self, name: str, a: str, b: str, what: str) -> None:
        lost = [f"{u} ({why})" for u, why in self.failed.items() if u in self.anc[a] | self.anc[b]]
        if lost:
            raise ValueError(
                f"graph node {name!r}: {what} of {a!r} and {b!r} needs their cross-covariance, "
                f"which could not be carried through node {', '.join(lost)}; use mode='diag' or "
                "a module with a cross-covariance rule"
            )

    def _add(self, name: str, a: str, b: Any) -> None:
        va = self.values[a]
        if not isinstance(b, str):  # a constant shift: Cov(w, a + c) = Cov(w, a)
            out = M.add_independent(va, float(b)) if isinstance(va, Gaussian) else va + b
            self._set(name, out, self.anc[a])
            self._combined_cross(name, [a], cat=False)
            return
        vb = self.values[b]
        anc = self.anc[a] | self.anc[b]
        if not isinstance(va, Gaussian) or not isinstance(vb, Gaussian):
            if tuple(va.shape) != tuple(vb.shape):
                raise ValueError(
                    f"graph node {name!r}: adding {a!r} {tuple(va.shape)} and {b!r} "
                    f"{tuple(vb.shape)}: broadcasting sums are not supported"
                )
            if isinstance(va, Gaussian) or isinstance(vb, Gaussian):
                out = M.add_independent(va, vb)
            else:
                out = va + vb
            self._set(name, out, anc)
            self._combined_cross(name, [a, b], cat=False)
            return
        if tuple(va.shape) != tuple(vb.shape):
            raise ValueError(
                f"graph node {name!r}: adding {a!r} {tuple(va.shape)} and {b!r} "
                f"{tuple(vb.shape)}: a sum of two Gaussians needs equal shapes"
            )
        cross = self._get(a, b) if _flat(va) and _flat(vb) else None
        if cross is _LOST:
            if self.mode.full:
                self._refuse_lost(name, a, b, "the sum")
            cross = None  # the stated approximation: correlated images summed as independent
        if cross is None:
            out = M.add_independent(va, vb)
        elif self.mode.full:
            mean, cov = M.residual_full(
                va.mean, M.skip_covariance(va), vb.mean, M.skip_covariance(vb), cross
            )
            out = Gaussian(mean, cov=cov, validate=False)
        else:
            mean, var = M.residual_diag(va.mean, va.var, vb.mean, vb.var, cross)
            out = Gaussian(mean, var=var, validate=False)
        self._set(name, out, anc)
        self._combined_cross(name, [a, b], cat=False)

    def _cat(self, name: str, inputs: Sequence[str], dim: int) -> None:
        values = [self.values[v] for v in inputs]
        anc = frozenset().union(*(self.anc[v] for v in inputs))
        rank = len(values[0].shape) - (1 if self.mode.samples else 0)
        if not -rank <= dim < rank or dim % rank == 0:
            raise ValueError(
                f"graph node {name!r}: torch.cat along dim={dim} of {rank}-D values; only a "
                "feature dimension (not the batch dimension 0) is supported"
            )
        if not any(isinstance(v, Gaussian) for v in values):
            shift = 1 if self.mode.samples and dim >= 0 else 0
            self._set(name, torch.cat(values, dim + shift), anc)  # type: ignore[arg-type]  # all tensors
            return
        gaussians = [
            v if isinstance(v, Gaussian) else Gaussian(v, var=torch.zeros_like(v)) for v in values
        ]
        if self.mode.full and all(_flat(g) for g in gaussians):
            out = self._joint(name, inputs, gaussians)
        else:
            out = Gaussian(
                torch.cat([g.mean for g in gaussians], dim),
                var=torch.cat([g.var for g in gaussians], dim),
                validate=False,
            )
        self._set(name, out, anc)
        if _flat(out):
            self._combined_cross(name, list(inputs), cat=True)

    def _joint(self, name: str, inputs: Sequence[str], gaussians: list[Gaussian]) -> Gaussian:
        """The full covariance of a concatenation, with the operands' cross-covariance blocks."""
        rows = []
        for i, (a, ga) in enumerate(zip(inputs, gaussians, strict=True)):
            row = []
            for j, (b, gb) in enumerate(zip(inputs, gaussians, strict=True)):
                block = M.skip_covariance(ga) if i == j else self._get(a, b)
                if block is _LOST:
                    self._refuse_lost(name, a, b, "the concatenation")
                    raise ValueError(
                        f"graph node {name!r}: torch.cat of {a!r} and {b!r} in full mode needs "
                        "their cross-covariance, which is not carried for values that were "
                        "images (per-pixel moments); use mode='diag'"
                    )
                row.append(_zero_cross(ga, gb) if block is None else block)
            rows.append(_cat_blocks(row, -1))
        cov = _cat_blocks(rows, -2)
        return Gaussian(torch.cat([g.mean for g in gaussians], -1), cov=cov, validate=False)
