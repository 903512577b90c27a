"""The compiled step's on-disk caches (issue 39, item 2): what makes a second run hit them.

AOTAutograd refuses, by default, to cache a graph holding a custom ``torch.autograd.Function``
(``BypassAOTAutogradCache``), and the dDVI ELBO holds three (the ReLU moments, the fused head,
the KL). ``lightning_dvi.compile`` turns on the flag that admits them. These tests check the
flag, the options handed on, and AOTAutograd's own cacheability verdict on the ELBO's Dynamo
graph (captured with a recording backend: no code generation, so the file stays fast). The
hit itself, and the time it saves, are measured by ``recipes/compile_cache.py`` in two fresh
interpreters (docs/speed_current.md).
"""

from __future__ import annotations

import pytest
import torch
from torch._functorch import config as functorch_config
from torch._functorch._aot_autograd.autograd_cache import BypassAOTAutogradCache, check_cacheable

import lightning_dvi.compile as compile_module
from lightning_dvi.compile import compile_elbo
from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.nn import mlp
from lightning_dvi.priors import GaussianPrior

FLAG = "autograd_cache_allow_custom_autograd_functions"


@pytest.fixture
def flag_off():
    """The flag starts at torch's default (off) and is restored afterwards."""
    with functorch_config.patch({FLAG: False}):
        yield


@pytest.mark.parametrize(
    "options", [{}, {"mode": "reduce-overhead"}, {"backend": "eager", "dynamic": True}]
)
def test_compile_wrappers_admit_custom_functions_and_keep_the_options(flag_off, options):
    assert compile_module._cache_friendly(options) == options
    assert getattr(functorch_config, FLAG) is True


def _dynamo_graph(flag_off) -> torch.fx.GraphModule:
    torch.manual_seed(0)
    net = mlp(1, [6, 5], 2)
    graphs: list[torch.fx.GraphModule] = []

    def recording_backend(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        graphs.append(gm)
        return gm.forward

    step = compile_elbo(
        net, HeteroscedasticGaussian(), GaussianPrior(), mode="diag", backend=recording_backend
    )
    step(torch.randn(8, 1), torch.randn(8), num_data=100).loss.backward()
    assert len(graphs) == 1  # one graph, no break
    return graphs[0]


def test_elbo_graph_is_admitted_to_the_aotautograd_cache(flag_off):
    gm = _dynamo_graph(flag_off)
    targets = {str(getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes}
    assert "autograd_function_apply" in targets  # the custom Functions are in the graph
    with torch._inductor.config.patch(fx_graph_cache=True):
        check_cacheable(gm)  # compile_elbo set the flag: no BypassAOTAutogradCache
        refused = pytest.raises(BypassAOTAutogradCache, match="autograd_function_apply")
        with functorch_config.patch({FLAG: False}), refused:  # torch's default refuses it
            check_cacheable(gm)
