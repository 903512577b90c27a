"""One moment interpreter: the Pyro front-end and nn/ agree exactly; no import cycles."""

from __future__ import annotations

import ast
from pathlib import Path

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi.nn import BayesLinear, Heaviside, ReLU, Residual, Sequential, mlp
from lightning_dvi.nn import registry as R
from lightning_dvi.propagation import propagation
from lightning_dvi.pyro import DeterministicGuide, MomentTensor, PyroBayesNet
from lightning_dvi.pyro.messenger import MomentPassMessenger

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_dvi"


@pytest.fixture
def float64(pyro_state):
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


def _moment_pass(model, guide, *args):
    weights = poutine.trace(guide.moment_posteriors).get_trace(*args).nodes["_RETURN"]["value"]
    with pyro.validation_enabled(False):
        return MomentPassMessenger(weights)(model)(*args)


def _load_guide_posterior(net, guide, prefix):
    """Copy the guide's posterior into the declared layers' own parameters."""
    with torch.no_grad():
        for path, layer in net.named_modules():
            if not isinstance(layer, BayesLinear):
                continue
            site = f"{prefix}.{path}" if path else prefix
            for part in ("weight", "bias"):
                loc, scale = guide._get_loc_and_scale(f"{site}.{part}")
                getattr(layer, f"{part}_loc").copy_(loc)
                getattr(layer, f"{part}_raw_scale").copy_(scale + torch.log(-torch.expm1(-scale)))


def _assert_same(out, ref, mode):
    assert isinstance(out, MomentTensor)
    torch.testing.assert_close(out.dvi_mean, ref.mean, rtol=0, atol=1e-12)
    if mode == "full":
        cov = out.dvi_cov if out.dvi_cov is not None else torch.diag_embed(out.dvi_var)
        torch.testing.assert_close(cov, ref.cov, rtol=0, atol=1e-12)
    else:
        torch.testing.assert_close(out.dvi_var, ref.var, rtol=0, atol=1e-12)


NETWORKS = {
    "mlp": lambda: mlp(3, [6, 6], 2),
    "residual_mlp": lambda: mlp(3, [6, 6, 6], 2, residual=True),
    "residual_heaviside": lambda: Sequential(
        BayesLinear(3, 6),
        Residual(ReLU(), BayesLinear(6, 6)),
        Residual(Heaviside(), BayesLinear(6, 6), ReLU(), BayesLinear(6, 6)),
        ReLU(),
        BayesLinear(6, 2),
    ),
    "nested_residual": lambda: Sequential(
        BayesLinear(3, 5),
        Residual(ReLU(), BayesLinear(5, 5), Residual(ReLU(), BayesLinear(5, 5))),
        Residual(Residual(ReLU(), BayesLinear(5, 5)), Heaviside(), BayesLinear(5, 5)),
        ReLU(),
        BayesLinear(5, 2),
    ),
}


@pytest.mark.parametrize("mode", ["full", "diag"])
@pytest.mark.parametrize("name", sorted(NETWORKS))
def test_pyro_bayes_net_equals_declared_network_in_float64(float64, name, mode):
    net = NETWORKS[name]()
    pnet = PyroBayesNet(net)
    x = torch.randn(5, 3)
    guide = DeterministicGuide(pnet, mode=mode, init_scale=0.3)
    out = _moment_pass(pnet, guide, x)
    _load_guide_posterior(net, guide, "net")
    with torch.no_grad():
        ref = net(x, mode=mode)
    _assert_same(out, ref, mode)


class _Tutorial(PyroModule):
    """A Pyro-tutorial network: PyroSample priors, three spellings of relu."""

    def __init__(self):
        super().__init__()
        sizes = [(3, 6), (6, 6), (6, 6), (6, 2)]
        self.layers = PyroModule[nn.ModuleList]([PyroModule[nn.Linear](i, o) for i, o in sizes])
        for layer, (i, o) in zip(self.layers, sizes, strict=True):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([o, i]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([o]).to_event(1))

    def forward(self, x):
        h = torch.relu(self.layers[0](x))
        h = F.relu(self.layers[1](h))
        h = nn.ReLU()(self.layers[2](h))
        return self.layers[3](h)


@pytest.mark.parametrize("mode", ["full", "diag"])
def test_hand_written_pyro_model_equals_declared_network_in_float64(float64, mode):
    model = _Tutorial()
    guide = DeterministicGuide(model, mode=mode, init_scale=0.3)
    x = torch.randn(5, 3)
    out = _moment_pass(model, guide, x)
    net = mlp(3, [6, 6, 6], 2)
    with torch.no_grad():
        for k, i in enumerate([0, 2, 4, 6]):  # mlp's BayesLinear positions
            layer = net[i]
            for part in ("weight", "bias"):
                loc, scale = guide._get_loc_and_scale(f"layers.{k}.{part}")
                getattr(layer, f"{part}_loc").copy_(loc)
                getattr(layer, f"{part}_raw_scale").copy_(scale + torch.log(-torch.expm1(-scale)))
        ref = net(x, mode=mode)
    _assert_same(out, ref, mode)


def test_a_registered_activation_runs_in_the_moment_pass_with_no_pyro_code(pyro_state):
    # The moment pass finds activations in the registry: register one (a ReLU standing for a
    # function nobody else registers; only the look-up matters here) and use it in a model.
    name = "_test_relu_alias"
    R.register_activation(name, torch_functions=(F.hardshrink,))(type("_Alias", (ReLU,), {}))
    try:
        pnet = PyroBayesNet(mlp(2, [4], 4))

        def model(x):
            return F.hardshrink(pnet(x))

        guide = DeterministicGuide(model, mode="full", init_scale=0.3)
        x = torch.randn(3, 2)
        out = _moment_pass(model, guide, x)
        pyro.set_rng_seed(0)
        before = _moment_pass(pnet, guide, x)
        ref = ReLU().propagate(before.gaussian("test"), propagation("full"))
        torch.testing.assert_close(out.dvi_cov, ref.cov)
    finally:
        R._SPECS.pop(name)


def test_pyro_bayes_net_refuses_declared_layers_it_cannot_make_sites_for():
    class Scaled(ReLU):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(()))

    with pytest.raises(NotImplementedError, match="declared module Scaled"):
        PyroBayesNet(Sequential(BayesLinear(2, 2), Scaled(), BayesLinear(2, 1)))


# --------------------------------------------------------------------------- import graph
def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(tree: ast.Module):
    """Import statements executed at import time (top level, inside top-level if/try)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body + node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody
            for handler in node.handlers:
                todo += handler.body


def import_graph() -> dict[str, set[str]]:
    """Module -> package modules it imports at module level."""
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _module_level_imports(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                module = node.module or ""
                base = f"{base}.{module}".strip(".") if node.level else module
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names
                ]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph, or ``None``."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_import_graph_sees_relative_imports():
    graph = import_graph()
    assert "lightning_dvi.pyro.moment_tensor" in graph["lightning_dvi.pyro.moment_rules"]
    assert "lightning_dvi.moments" in graph["lightning_dvi.nn.linear"]


def test_the_package_has_no_import_cycle():
    assert find_cycle(import_graph()) is None


def test_adding_a_layer_page_runs_and_checks_against_monte_carlo():
    import re

    doc = (PACKAGE.parent / "docs" / "adding_a_layer.md").read_text()
    namespace: dict = {}
    try:
        for block in re.findall(r"```python\n(.*?)```", doc, re.S):
            exec(compile(block, "docs/adding_a_layer.md", "exec"), namespace)
    finally:
        R._SPECS.pop("doc_scaled_relu", None)
    assert "fidelity" in namespace


def _every_import(tree: ast.Module):
    """Every import statement, function-local ones included (not ``if TYPE_CHECKING:``)."""
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom) and id(node) not in skip:
            yield node


def test_the_package_has_no_import_cycle_even_through_function_local_imports(monkeypatch):
    # A function-local import that points back up (the old soft_relu in moments/special.py
    # importing moments/activations.py) hides a cycle from the module-level graph.
    monkeypatch.setitem(globals(), "_module_level_imports", _every_import)
    graph = import_graph()
    assert find_cycle(graph) is None, find_cycle(graph)
