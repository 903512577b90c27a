r"""Convert any module ``torch.fx`` can trace into a :class:`~lightning_dvi.nn.GraphNetwork`.

:func:`graph_from_torch` traces the module symbolically (``torch.fx.Tracer``: torch's own layers
stay leaves, user modules and ``nn.Sequential`` are traced through) and maps every node through
the layer registry:

* ``call_module``: the registered kind of the module's type (``spec_for_module``), converted as
  :func:`~lightning_dvi.nn.from_torch` converts a layer; dropped layers (dropout, identity)
  vanish; a parameter-free module may be called several times, a weight layer once;
* ``call_function`` / ``call_method``: the registered kind of the function (``spec_for_function``:
  ``F.relu``, ``torch.tanh``, ``x.relu()``, ``torch.flatten``, ``F.adaptive_avg_pool2d``, ...),
  ``x.view(x.size(0), -1)``, ``x.view(-1, N)`` and ``reshape`` of those flattening kinds (the
  batch kept: ``N`` is checked at run time), ``operator.add`` /
  ``torch.add`` / ``+=`` of two values or of a number, ``torch.cat`` along a feature dimension,
  and ``x.contiguous()`` (dropped);
* in-place operations (``x.relu_()``, ``F.relu_(x)``, ``F.relu(x, inplace=True)``,
  ``nn.ReLU(inplace=True)``, ``x.add_(y)``, ``x += y``): converted as their out-of-place
  versions, and every later read of the modified tensor reads the result (as in torch); an
  in-place operation on a tensor that shares memory with a view of it is refused.

Anything else raises ``NotImplementedError`` naming the node, its op and target, the module it
sits in and its source line, and the supported list.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from typing import Any, Literal, overload

import torch
from torch import Tensor, fx, nn

from .base import BayesModule
from .container import Sequential
from .graph import GraphNetwork
from .registry import ConversionOptions, spec_for_function, spec_for_module
from .torch_layers import describe_layer, plain

__all__ = ["SUPPORTED_GRAPH_OPS", "graph_from_torch"]

SUPPORTED_GRAPH_OPS = (
    "registered torch modules (Linear, Conv2d, AvgPool2d, MaxPool2d, AdaptiveAvgPool2d, Flatten, "
    "the activations, normalization layers, Dropout/Identity dropped), registered torch "
    "functions and tensor methods (F.relu, torch.relu, x.relu(), torch.tanh, F.gelu, F.elu, "
    "torch.flatten, x.flatten, F.adaptive_avg_pool2d, ...) and their in-place forms (x.relu_(), "
    "inplace=True), x.view/x.reshape(x.size(0), -1) or (-1, N), "
    "operator.add / torch.add / x.add_ / += of two values or of a number, torch.cat along a feature "
    "dimension, x.contiguous(); transformers: nn.MultiheadAttention as self-attention "
    "(attn(h, h, h, attn_mask=causal buffer, need_weights=False)[0]), "
    "nn.TransformerEncoderLayer (batch_first), nn.Embedding, nn.RMSNorm, x + a [T, D] "
    "parameter or buffer (positional table), x.mean(dim=1)"
)

_ADD = (operator.add, operator.iadd, torch.add, Tensor.add, Tensor.__add__, Tensor.__radd__)
_IN_PLACE = (operator.iadd,)  # besides the `name_` methods and functions and `inplace=True`
_CAT = (torch.cat, torch.concat, torch.concatenate)
_RESHAPE = (Tensor.view, Tensor.reshape, torch.reshape)
_NO_OP = (Tensor.contiguous,)
_MEAN = (torch.mean, Tensor.mean)


def _spec_named(name: str) -> Any:
    from .registry import layer_specs

    return next(s for s in layer_specs() if s.name == name)


def _target(node: fx.Node) -> Callable[..., Any] | None:
    if node.op == "call_method":
        return getattr(Tensor, str(node.target), None)
    return node.target if callable(node.target) else None


def _out_of_place(fn: Callable[..., Any], method: bool) -> Callable[..., Any] | None:
    """``Tensor.relu`` for ``Tensor.relu_``, ``torch.relu`` for ``F.relu_``, ...; else ``None``."""
    name = getattr(fn, "__name__", "")
    if not name.endswith("_") or name.endswith("__"):
        return None
    spaces: tuple[Any, ...] = (Tensor,) if method else (torch, nn.functional)
    found = (getattr(space, name[:-1], None) for space in spaces)
    return next((f for f in found if callable(f)), None)


def _where(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    paths = [str(v[0]) for v in stack.values()] if isinstance(stack, dict) else []
    module = paths[-1] if paths and paths[-1] else "the top-level forward"
    target = (
        node.target
        if isinstance(node.target, str)
        else getattr(node.target, "__name__", repr(node.target))
    )
    text = f"node {node.name!r} ({node.op} {target}) in {module}"
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', node.stack_trace or "")
    user = [f for f in frames if "/torch/" not in f[0].replace("\\", "/")]
    if user:
        path, line, code = user[-1]
        text += f" at {path}:{line}: {code.strip()}"
    return text


class _NodeError(NotImplementedError):
    """A node that cannot be converted; the message is written once its source line is known."""

    def __init__(self, node: fx.Node, why: str, listing: bool = True) -> None:
        super().__init__(why)
        self.node, self.why, self.listing = node, why, listing

    def message(self, traced: fx.Node | None) -> str:
        text = f"from_torch: {_where(traced or self.node)} {self.why}"
        return f"{text}; graph conversion supports {SUPPORTED_GRAPH_OPS}" if self.listing else text


def _unsupported(node: fx.Node, why: str = "is not supported") -> _NodeError:
    return _NodeError(node, why)


def _trace(module: nn.Module, stacks: bool = False) -> fx.Graph:
    tracer = fx.Tracer()
    tracer.record_stack_traces = stacks  # slow (seconds per node on a cold start): errors only
    try:
        return tracer.trace(module)
    except Exception as err:  # fx raises TraceError, TypeError, RuntimeError, ... by construct
        raise NotImplementedError(
            f"from_torch: torch.fx could not trace {type(module).__name__} "
            f"({type(err).__name__}: {err}). Graph conversion needs a forward without "
            "data-dependent control flow (no `if` or loop on tensor values); write that part "
            "with tensor operations, or convert the traceable submodules separately"
        ) from err


def _is_batch_size(arg: Any, source: fx.Node) -> bool:
    """``x.size(0)`` or ``x.shape[0]`` of the tensor being reshaped."""
    if not isinstance(arg, fx.Node):
        return False
    if arg.op == "call_method" and arg.target == "size":
        return list(arg.args) == [source, 0]
    if arg.op == "call_function" and arg.target is operator.getitem and arg.args[1] == 0:
        shape = arg.args[0]
        return (
            isinstance(shape, fx.Node)
            and shape.op == "call_function"
            and shape.target is getattr
            and list(shape.args) == [source, "shape"]
        )
    return False


def _flat(node: fx.Node) -> dict[str, Any]:
    """The flattening a ``view``/``reshape`` node stands for: ``{}`` or ``{"features": N}``.

    ``x.view(x.size(0), -1)`` (any batch size spelling: ``x.shape[0]``) flattens every
    dimension after the batch; ``x.view(-1, N)`` and ``x.view(x.size(0), N)`` do the same and
    check at run time that a row has ``N`` values (else the batch size would change).

    Raises:
        _NodeError: for any other shape.
    """
    args = list(node.args)
    shape = args[1:] if not (len(args) == 2 and isinstance(args[1], (list, tuple))) else args[1]
    source = args[0]
    if isinstance(source, fx.Node) and len(shape) == 2 and not node.kwargs:
        batch: Any = shape[0]
        features: Any = shape[1]
        if features == -1 and _is_batch_size(batch, source):
            return {}
        is_int = isinstance(features, int) and not isinstance(features, bool)
        if is_int and features > 0 and (batch == -1 or _is_batch_size(batch, source)):
            return {"features": features}
    raise _unsupported(
        node, "is a reshape other than x.view(x.size(0), -1), x.view(-1, N) or x.view(B, N)"
    )


class _Builder:
    def __init__(self, root: nn.Module, options: ConversionOptions, several_inputs: bool) -> None:
        self.root, self.options, self.several_inputs = root, options, several_inputs
        self.nodes: list[dict[str, Any]] = []
        self.table: dict[str, dict[str, Any]] = {}
        self.built: dict[str, BayesModule] = {}
        self.alias: dict[str, str] = {}
        self.helpers: set[str] = set()  # x.size(0) / x.shape nodes, read by a flattening view
        self.called: dict[str, str] = {}  # torch module path -> key
        self.viewed: set[str] = set()  # values that share memory with a view of them
        self.constants: dict[str, Tensor] = {}  # get_attr nodes: parameters/buffers read directly
        self.pairs: set[str] = set()  # nodes whose value is (output, weights): attention calls

    def ref(self, arg: Any, node: fx.Node) -> str:
        if not isinstance(arg, fx.Node) or arg.name in self.helpers:
            raise _unsupported(node, f"has a non-tensor operand {arg!r}")
        return self.alias.get(arg.name, arg.name)

    def mutate(self, node: fx.Node, operand: Any) -> None:
        """``node`` modified ``operand`` in place: later reads of it read ``node``'s value.

        fx records ``h.relu_()`` (or ``F.relu(h, inplace=True)``, ``h += y``) as a node, but a
        later ``h`` in the source is still the node before it; every name that stands for that
        tensor is redirected to ``node`` from here on (earlier readers read it before).
        """
        if node.name in self.alias:  # a dropped in-place module (Dropout(inplace=True))
            return
        source = self.ref(operand, node)
        if source in self.viewed:
            raise _unsupported(
                node,
                "modifies in place a tensor that shares memory with a view of it (view, "
                "reshape, flatten); write that operation out of place",
            )
        for name, target in list(self.alias.items()):
            if target == source:
                self.alias[name] = node.name
        self.alias[source] = node.name

    def view(self, node: fx.Node, source: Any) -> None:
        """``node`` is a view of ``source`` (they share memory)."""
        self.viewed.update({self.ref(source, node), node.name})

    def add_module(self, key: str, module: BayesModule, description: dict[str, Any]) -> str:
        key = re.sub(r"\W", "_", key) or "module"
        base, i = key, 1
        while key in self.table:
            key, i = f"{base}_{i}", i + 1
        self.table[key], self.built[key] = description, module
        return key

    def call(self, node: fx.Node, key: str, source: Any) -> None:
        self.nodes.append(
            {"name": node.name, "op": "call", "module": key, "inputs": [self.ref(source, node)]}
        )

    def visit(self, node: fx.Node) -> None:
        if node.op == "placeholder":
            if self.nodes and not self.several_inputs:
                raise _unsupported(node, "is a second input; a converted network takes one")
            self.nodes.append({"name": node.name, "op": "input"})
        elif node.op == "output":
            if not isinstance(node.args[0], fx.Node):
                raise _unsupported(
                    node, "returns a structure; a converted network returns one tensor"
                )
            self.nodes.append(
                {"name": "output", "op": "output", "inputs": [self.ref(node.args[0], node)]}
            )
        elif node.op == "call_module":
            self.visit_module(node)
        elif node.op in ("call_function", "call_method"):
            self.visit_function(node)
        elif node.op == "get_attr":  # read where it is used: a positional table, a mask
            value = self.root
            for part in str(node.target).split("."):
                value = getattr(value, part)
            if not isinstance(value, Tensor):
                raise _unsupported(node, "reads an attribute that is not a tensor")
            self.constants[node.name] = value.detach()
        else:
            raise _unsupported(node, "(a parameter or buffer read directly) is not supported")

    def attention_call(self, node: fx.Node, module: nn.MultiheadAttention) -> bool:
        """``attn(h, h, h, attn_mask=causal, need_weights=False)``: self-attention; its causal flag.

        Returns whether the call is causal. Self-attention only (query, key and value the same
        value); ``attn_mask`` a constant causal mask (a buffer: bool ``True`` above the
        diagonal, or ``-inf`` there) or ``is_causal=True`` with it; ``key_padding_mask`` is a
        run-time input: pass it with :func:`lightning_dvi.nn.key_padding` instead.
        """
        names = ("query", "key", "value")
        given = list(node.args) + [
            node.kwargs[n] for n in names[len(node.args) :] if n in node.kwargs
        ]
        if len(given) != 3 or not (given[0] is given[1] is given[2]):
            raise _unsupported(
                node, "is not self-attention (query, key and value must be one value)"
            )
        extra = {k: v for k, v in node.kwargs.items() if k not in names}
        for key in extra:
            if key not in ("attn_mask", "need_weights", "is_causal", "average_attn_weights"):
                raise _unsupported(
                    node,
                    f"passes {key}=; a key padding mask is given at run time with "
                    "lightning_dvi.nn.key_padding(mask)",
                )
        mask = extra.get("attn_mask")
        if mask is None:
            if extra.get("is_causal"):
                raise _unsupported(node, "sets is_causal=True without an attn_mask")
            return False
        if not isinstance(mask, fx.Node) or mask.name not in self.constants:
            raise _unsupported(node, "passes an attn_mask that is not a constant (a buffer)")
        value = self.constants[mask.name]
        t = value.shape[-1]
        upper = torch.ones(t, t, dtype=torch.bool, device=value.device).triu(1)
        causal = (
            value.dim() == 2
            and value.shape[0] == t
            and (
                bool(torch.equal(value, upper))
                if value.dtype == torch.bool
                else bool(torch.equal(torch.isneginf(value), upper))
                and bool((value[~upper] == 0).all())
            )
        )
        if not causal:
            raise _unsupported(node, "passes an attn_mask other than the causal mask")
        return True

    def visit_module(self, node: fx.Node) -> None:
        path = str(node.target)
        module = self.root.get_submodule(path)
        causal = None
        if isinstance(module, nn.MultiheadAttention):
            causal = self.attention_call(node, module)
            node.args, node.kwargs = (node.args[0],), {}
            self.pairs.add(node.name)
        if len(node.args) != 1 or node.kwargs:
            raise _unsupported(node, "is called with more than one argument")
        if isinstance(module, BayesModule):
            raise _unsupported(node, "is already a lightning_dvi module")
        if path in self.called:
            if any(True for _ in module.parameters()):
                raise _unsupported(
                    node, "reuses a module with weights (weight sharing is not supported)"
                )
            self.call(node, self.called[path], node.args[0])
            if getattr(module, "inplace", False) is True:
                self.mutate(node, node.args[0])
            return
        spec = spec_for_module(module)
        if spec is None:
            raise _unsupported(node, f"calls {type(module).__name__}, which has no layer kind")
        try:
            converted = spec.convert_module(module, self.options)
        except (NotImplementedError, ValueError) as err:
            raise _NodeError(node, f"cannot be converted: {err}", listing=False) from err
        if converted is None:
            self.alias[node.name] = self.ref(node.args[0], node)
            return
        if causal is not None:
            converted.causal = causal  # type: ignore[assignment]  # a MultiheadAttention
        description: dict[str, Any]
        if spec.describe is not None:
            description = {"kind": spec.name, "kwargs": spec.describe(converted)}
        else:
            try:
                description = {"kind": spec.name, "torch": describe_layer(module, path)}
            except ValueError as err:
                description = {"kind": spec.name, "unstorable": str(err)}
        self.called[path] = self.add_module(path, converted, description)
        self.call(node, self.called[path], node.args[0])
        if spec.kind == "shape":
            self.view(node, node.args[0])
        if getattr(module, "inplace", False) is True:  # nn.ReLU(inplace=True), ...
            self.mutate(node, node.args[0])

    def visit_function(self, node: fx.Node) -> None:
        fn = _target(node)
        args, kwargs = list(node.args), dict(node.kwargs)
        in_place = kwargs.pop("inplace", False) is True or fn in _IN_PLACE
        out_of_place = None if fn is None else _out_of_place(fn, node.op == "call_method")
        if out_of_place is not None:  # x.relu_(), F.relu_(x), x.add_(y): in place
            fn, in_place = out_of_place, True
        self.visit_call(node, fn, args, kwargs)
        if in_place and args:
            self.mutate(node, args[0])

    def visit_call(
        self, node: fx.Node, fn: Callable[..., Any] | None, args: list[Any], kwargs: dict[str, Any]
    ) -> None:
        if (node.op == "call_method" and node.target == "size") or fn is getattr:
            self.helpers.add(node.name)  # checked where it is read
        elif (
            fn is operator.getitem and isinstance(args[0], fx.Node) and args[0].name in self.helpers
        ):
            self.helpers.add(node.name)
        elif fn is operator.getitem and isinstance(args[0], fx.Node) and args[0].name in self.pairs:
            if args[1] != 0:
                raise _unsupported(node, "reads the attention weights; only the output [0] is kept")
            self.alias[node.name] = self.ref(args[0], node)
        elif fn in _ADD:
            self.visit_add(node, args, kwargs)
        elif fn in _CAT:
            tensors = args[0] if args else kwargs.get("tensors")
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int):
                raise _unsupported(node, "has arguments that are not a list of tensors and a dim")
            self.nodes.append(
                {
                    "name": node.name,
                    "op": "cat",
                    "dim": dim,
                    "inputs": [self.ref(t, node) for t in tensors],
                }
            )
        elif fn in _RESHAPE:
            self.function(node, spec_for_function(torch.flatten), args[0], [1, -1], _flat(node))
            self.view(node, args[0])
        elif fn in _NO_OP:
            self.alias[node.name] = self.ref(args[0], node)
        elif fn in _MEAN:  # x.mean(dim=1) of a sequence: the tokens' mean
            self.function(node, _spec_named("mean_tokens"), args[0], args[1:], kwargs)
        else:
            spec = None if fn is None else spec_for_function(fn)
            if spec is None or not args:
                raise _unsupported(node)
            self.function(node, spec, args[0], args[1:], kwargs)
            if spec.kind == "shape":
                self.view(node, args[0])

    def function(
        self, node: fx.Node, spec: Any, source: Any, args: list[Any], kwargs: dict[str, Any]
    ) -> None:
        try:
            args = [plain(a, "argument") for a in args]
            kwargs = {k: plain(v, f"argument {k}") for k, v in kwargs.items()}
            module = spec.build_from_call(*args, **kwargs)
        except (NotImplementedError, ValueError, TypeError) as err:
            raise _NodeError(node, f"cannot be converted: {err}", listing=False) from err
        key = self.add_module(
            node.name, module, {"kind": spec.name, "args": args, "kwargs": kwargs}
        )
        self.call(node, key, source)

    def positional(self, node: fx.Node, table_node: fx.Node, source: Any) -> None:
        """``x + table`` with a parameter or buffer ``[T, D]`` (or ``[1, T, D]``)."""
        from .sequence import PositionalEncoding

        table = self.constants[table_node.name]
        if table.dim() == 3 and table.shape[0] == 1:
            table = table[0]
        if table.dim() != 2:
            raise _unsupported(node, "adds a tensor that is not a [T, D] positional table")
        learned = str(table_node.target) in dict(self.root.named_parameters())
        module = PositionalEncoding(table.shape[0], table.shape[1], learned=learned)
        module = module.to(device=table.device, dtype=table.dtype)
        with torch.no_grad():
            module.table.copy_(table)
        description = {
            "kind": "positional_encoding",
            "kwargs": {
                "num_positions": table.shape[0],
                "embedding_dim": table.shape[1],
                "learned": learned,
            },
        }
        key = self.add_module(str(table_node.target), module, description)
        self.call(node, key, source)

    def visit_add(self, node: fx.Node, args: list[Any], kwargs: dict[str, Any]) -> None:
        if kwargs or len(args) != 2:
            raise _unsupported(node, "is an add with alpha or other keyword arguments")
        constant = [a for a in args if isinstance(a, fx.Node) and a.name in self.constants]
        if len(constant) == 1:  # x + table: a positional encoding
            self.positional(node, constant[0], next(a for a in args if a is not constant[0]))
            return
        operands: list[Any] = []
        for a in args:
            if isinstance(a, fx.Node):
                operands.append(self.ref(a, node))
            elif isinstance(a, (int, float)) and not isinstance(a, bool):
                operands.append(float(a))
            else:
                raise _unsupported(node, f"adds {a!r}; only values and numbers")
        if not isinstance(operands[0], str):
            operands.reverse()
        if not isinstance(operands[0], str):
            raise _unsupported(node, "adds two numbers")
        self.nodes.append({"name": node.name, "op": "add", "inputs": operands})


@overload
def graph_from_torch(
    module: nn.Module,
    options: ConversionOptions,
    *,
    several_inputs: bool = ...,
    chain: Literal["graph"] = ...,
) -> GraphNetwork: ...


@overload
def graph_from_torch(
    module: nn.Module,
    options: ConversionOptions,
    *,
    several_inputs: bool = ...,
    chain: Literal["sequential"],
) -> GraphNetwork | Sequential: ...


def graph_from_torch(
    module: nn.Module,
    options: ConversionOptions,
    *,
    several_inputs: bool = False,
    chain: Literal["graph", "sequential"] = "graph",
) -> GraphNetwork | Sequential:
    """Trace ``module`` with ``torch.fx`` and build the equivalent :class:`GraphNetwork`.

    Args:
        module: any ``nn.Module`` whose forward ``torch.fx`` can trace, taking one tensor and
            returning one tensor.
        options: the conversion options (``from_torch``'s ``init``, ``scale_fraction``, ...).
        several_inputs: accept a forward of several tensors (a graph of several ``input``
            nodes, called with a tuple); ``False`` refuses a second input.
        chain: ``"sequential"``: a graph of one input in which every node calls one module on
            the previous node's value (no sums, no concatenations) is returned as a
            :class:`~lightning_dvi.nn.Sequential` of those modules, in order; ``"graph"``:
            always a :class:`GraphNetwork` (storable as plain data).

    Raises:
        NotImplementedError: for an untraceable module (saying why fx failed) or a node that
            has no declared equivalent (naming it, its op/target, module and source line).
    """
    builder = _Builder(module, options, several_inputs)
    try:
        for node in _trace(module).nodes:
            builder.visit(node)
    except _NodeError as err:  # trace again, with source lines, to name the line
        traced = {n.name: n for n in _trace(module, stacks=True).nodes}
        raise NotImplementedError(err.message(traced.get(err.node.name))) from err
    used = {v for n in builder.nodes for v in n.get("inputs", []) if isinstance(v, str)}
    inputs = {n["name"] for n in builder.nodes if n["op"] == "input"}
    if builder.nodes[-1]["inputs"][0] in inputs or not builder.built:
        raise ValueError("from_torch: nothing left to convert (only dropped layers)")
    unused = [n["name"] for n in builder.nodes[:-1] if n["name"] not in used]
    if unused:
        raise NotImplementedError(
            f"from_torch: the values of nodes {unused} are computed but never used; a converted "
            "network follows one output"
        )
    layers = _chain(builder.nodes, builder.built) if chain == "sequential" else None
    if layers is not None:
        return Sequential(*layers)
    return GraphNetwork(builder.nodes, builder.table, options.layer_kwargs, built=builder.built)


def _chain(nodes: list[dict[str, Any]], built: dict[str, BayesModule]) -> list[BayesModule] | None:
    """The modules of a chain (one input, each node calling a module on the previous value)."""
    layers, previous = [], nodes[0]["name"]
    for node in nodes[1:-1]:
        if node["op"] != "call" or node["inputs"] != [previous]:
            return None
        layers.append(built[node["module"]])
        previous = node["name"]
    return layers if nodes[-1]["inputs"] == [previous] else None
