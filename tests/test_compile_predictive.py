"""A converted transformer's one-pass predictive traces into one ``torch.compile`` graph.

The compiled predictive is the fast path of issue 42 (``docs/transformer_benchmark.md``): in
eager mode the moment pass is dispatch-bound, and a graph break leaves most of it there. These
tests trace with ``fullgraph=True`` (any break fails) and ``backend="eager"`` (Dynamo only, no
code generation, so they stay fast), and compare with the eager pass, under a key padding mask
too: the mask reaches the attention layers through a context block, which the tracer must see
and guard on (a new mask, or none, must not reuse the old trace).
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_dvi.compile import compile_network
from lightning_dvi.nn import key_padding
from lightning_dvi.nn.posthoc import from_torch_posterior, prior_std
from tests.transformer_models import TinyViT, randomize_norms

CHEAP = {
    "attention_rule": "mean",
    "layer_norm_route": "first_order",
    "gelu_rule": "slope",
    "skip_rule": "independent",
}


def _net(rules: dict[str, str]) -> nn.Module:
    torch.manual_seed(0)
    model = randomize_norms(TinyViT(patches=4, patch_dim=6, width=8, heads=2, layers=2))
    model = model.double()  # float64: the traced and eager passes agree to 1e-12
    return from_torch_posterior(model.eval(), prior_std(model, 0.05), **rules).eval()


def test_diag_predictive_traces_in_one_graph():
    # the cheap rules of the benchmark's compiled row; the library's (unscented attention,
    # quadrature GELU) also trace in one graph, at 15 s a trace, too slow for the suite
    torch._dynamo.reset()
    net = _net(CHEAP)

    # the library's front door (docs/posthoc.md), the input's value check outside the graph
    compiled = compile_network(net, backend="eager", fullgraph=True, dynamic=False)
    x = torch.randn(5, 4, 6, dtype=torch.float64)
    with torch.no_grad():
        want, got = net(x, mode="diag"), compiled(x, mode="diag")
    for a, b in ((got.mean, want.mean), (got.var, want.var)):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert bool((want.var > 0).all())  # a real posterior: the variances are not zero


def test_compiled_predictive_follows_the_key_padding_block():
    torch._dynamo.reset()
    torch.manual_seed(1)
    model = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True, norm_first=True)
    net = from_torch_posterior(model.eval(), prior_std(model, 0.05), **CHEAP).eval()

    def moments(x: torch.Tensor) -> torch.Tensor:
        return net(x, mode="diag").mean

    compiled = torch.compile(moments, backend="eager", fullgraph=True)
    x = torch.randn(2, 5, 8)
    first = torch.tensor([[False, False, False, True, True], [False] * 5])
    second = torch.tensor([[False] * 5, [False, True, True, True, True]])
    with torch.no_grad():
        plain = moments(x)
        for mask in (first, second, None):
            with key_padding(mask):
                want = moments(x)
                torch.testing.assert_close(compiled(x), want)
            if mask is not None:  # the mask changes the answer: the check above can fail
                assert not torch.allclose(want, plain, atol=1e-4)
        torch.testing.assert_close(compiled(x), plain)  # outside every block: no mask
