"""A converted network's moment rules travel with its architecture (lightning_dvi.nn.rules)."""

from __future__ import annotations

import io
import json

import pytest
import torch
from torch import nn

from lightning_dvi.nn import GraphNetwork, from_torch, posthoc
from lightning_dvi.nn.graph import build_node_module
from lightning_dvi.nn.rules import apply_rules, module_rules


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.act = nn.GELU()
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(self.act(self.norm(self.inp(x)))).mean(1))


def _converted() -> GraphNetwork:
    torch.manual_seed(0)
    net = from_torch(_Block(), scale_fraction=0.1).double()
    assert isinstance(net, GraphNetwork)
    return net


def _rebuilt(net: GraphNetwork) -> GraphNetwork:
    """Through a checkpoint: plain data (JSON) and a weights-only state dict."""
    architecture = json.loads(json.dumps(net.architecture()))
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    buffer.seek(0)
    again = GraphNetwork(**architecture).double()
    again.load_state_dict(torch.load(buffer, weights_only=True))
    return again


def _rules(net: nn.Module) -> dict[str, object]:
    return {
        f"{path}.{attr}": value
        for path, values in module_rules(net).items()
        for attr, value in values.items()
    }


def test_rules_set_after_conversion_come_back_and_give_the_same_moments():
    net = _converted()
    x = torch.randn(3, 5, 4, dtype=torch.float64)
    defaults = net(x, mode="diag").var
    changed = posthoc.set_rules(
        net,
        attention_rule="mean",
        layer_norm_route="first_order",
        gelu_rule="closed",
        skip_rule="independent",
    )
    assert changed >= 5  # the top LayerNorm and GELU, the block, its attention and norms
    want = net(x, mode="diag")
    assert not torch.allclose(want.var, defaults)  # the rules change the numbers
    again = _rebuilt(net)
    assert _rules(again) == _rules(net)
    got = again(x, mode="diag")
    torch.testing.assert_close(got.mean, want.mean, rtol=0, atol=0)
    torch.testing.assert_close(got.var, want.var, rtol=0, atol=0)


def test_a_description_without_rules_builds_the_defaults():
    net = _converted()
    fresh = _rules(net)
    posthoc.set_rules(net, layer_norm_route="first_order")
    architecture = net.architecture()
    for description in architecture["modules"].values():
        description.pop("rules", None)
    assert _rules(GraphNetwork(**architecture)) == fresh


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ({"": {"route": "third_order"}}, "route: expected one of"),
        ({"": {"eps": 0.5}}, "'eps' is not a rule of LayerNorm"),
        ({"": {"__class__": "GELU"}}, "is not a rule of LayerNorm"),
        ({"missing": {"route": "auto"}}, "no submodule 'missing'"),
        (["route"], "expected a mapping of submodule paths"),
    ],
)
def test_rules_outside_the_table_are_refused(rules, message):
    description = {
        "kind": "layer_norm",
        "torch": {"type": "LayerNorm", "normalized_shape": [4], "eps": 1e-5},
        "rules": rules,
    }
    with pytest.raises(ValueError, match=message):
        build_node_module(description, "modules['norm']")


def test_gelu_rules_are_checked_against_the_variant():
    net = from_torch(nn.Sequential(nn.Linear(2, 3), nn.GELU(approximate="tanh")))
    gelu = net.layers[1] if not isinstance(net, GraphNetwork) else net.layers["1"]
    with pytest.raises(ValueError, match=r"approximate='none'\) only"):
        apply_rules(gelu, {"": {"rule": "closed"}}, "gelu")


def test_a_torch_network_from_a_layer_list_keeps_its_rules_too(tmp_path):
    from lightning_dvi.nn import TorchNetwork, save_torch_network

    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.GELU(), nn.Linear(8, 3))
    save_torch_network(module, tmp_path / "net.pt")
    net = TorchNetwork(path=str(tmp_path / "net.pt"))
    assert "rules" in net.architecture()  # the defaults are recorded as well
    x = torch.randn(5, 4)
    posthoc.set_rules(net, layer_norm_route="first_order", gelu_rule="closed")
    want = net(x, mode="diag")
    architecture = json.loads(json.dumps(net.architecture()))
    again = TorchNetwork(**architecture)
    again.load_state_dict(net.state_dict())
    assert (
        _rules(again) == _rules(net) == {"layers.1.route": "first_order", "layers.2.rule": "closed"}
    )
    got = again(x, mode="diag")
    torch.testing.assert_close(got.var, want.var, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"no submodule 'layers\.7'"):
        TorchNetwork(**{**architecture, "rules": {"layers.7": {"route": "auto"}}})
