"""Compiled training steps (``lightning_dvi.compile``, ``compile=`` on the Lightning modules).

The compiled hot path must trace as one graph (``fullgraph=True``: a host read or any other
graph break raises), give the eager ELBO's value and gradients, keep every value check on
(outside the compiled region) and not recompile when the KL weight changes. Compilation uses
``backend="aot_eager"`` (traced and functionalised, forward and backward graphs, no code
generation) so the file stays fast on CPU; inductor itself is what runs in practice.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.compile import compile_elbo, compile_network, compile_options, compile_step
from lightning_dvi.likelihoods import Categorical, HeteroscedasticGaussian
from lightning_dvi.nn import mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes
from tests.helpers import cpu_trainer

OPTS = {"backend": "aot_eager", "fullgraph": True}
FAST = {"backend": "eager", "fullgraph": True}  # Dynamo only: graph breaks still raise


def _problem(kind: str):
    torch.manual_seed(0)
    x = torch.randn(6, 3, dtype=torch.float64)
    if kind == "regression":
        return mlp(3, [5, 4], 2).double(), HeteroscedasticGaussian(), x, torch.randn(6).double()
    return mlp(3, [5, 4], 3).double(), Categorical(3), x, torch.randint(0, 3, (6,))


def _grads(net):
    return [p.grad.clone() for p in net.parameters()]


@pytest.mark.parametrize(("kind", "mode"), [("regression", "full"), ("classification", "diag")])
def test_compiled_elbo_matches_eager_values_and_gradients(kind, mode):
    net, lik, x, y = _problem(kind)
    prior = EmpiricalBayes()
    eager = elbo(net, lik, prior, x, y, num_data=50, mode=mode, kl_weight=0.3)
    eager.loss.backward()
    expected = _grads(net)
    net.zero_grad()
    step = compile_elbo(net, lik, prior, mode=mode, **OPTS)
    terms = step(x, y, num_data=50, kl_weight=0.3)
    terms.loss.backward()
    torch.testing.assert_close(terms.loss, eager.loss, rtol=1e-12, atol=0)
    torch.testing.assert_close(terms.elbo, eager.elbo, rtol=1e-12, atol=0)
    for got, want in zip(_grads(net), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-14)


def test_compiled_sampling_mode_traces_as_one_graph():
    net, lik, x, y = _problem("regression")
    step = compile_elbo(net, lik, EmpiricalBayes(), mode="local", num_samples=2, **FAST)
    step(x, y, num_data=50).loss.backward()


@pytest.mark.parametrize("factory", [compile_elbo, compile_step])
def test_value_checks_stay_on_outside_the_compiled_region(factory):
    """Both compiled objectives (the forward compiled, the whole step recorded) keep them."""
    net, lik, x, y = _problem("classification")
    step = factory(net, lik, EmpiricalBayes(), mode="full", **FAST)
    bad_x = x.clone()
    bad_x[0, 0] = float("nan")
    with pytest.raises(ValueError, match="input contains NaN or Inf"):
        step(bad_x, y, num_data=50)
    with pytest.raises(ValueError, match="labels out of range"):
        step(x, torch.full_like(y, 3), num_data=50)
    with pytest.raises(ValueError, match="num_data"):
        step(x, y, num_data=0)
    with torch.no_grad():
        next(net.parameters()).fill_(float("inf"))
    with pytest.raises(FloatingPointError, match="not finite"):
        step(x, y, num_data=50)
    reg_net, reg_lik, rx, ry = _problem("regression")
    reg_step = factory(reg_net, reg_lik, EmpiricalBayes(), mode="diag", **FAST)
    ry[1] = float("inf")
    with pytest.raises(ValueError, match="targets contain NaN or Inf"):
        reg_step(rx, ry, num_data=50)


def test_kl_weight_schedule_does_not_recompile():
    net, lik, x, y = _problem("regression")
    graphs = []

    def counting_backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    step = compile_elbo(net, lik, EmpiricalBayes(), mode="full", backend=counting_backend)
    for w in (0.0, 0.25, 0.5, 1.0):
        step(x, y, num_data=50, kl_weight=w).loss.backward()
    assert len(graphs) == 1


def test_compiled_network_matches_eager_and_checks_its_input():
    net, _, x, _ = _problem("regression")
    forward = compile_network(net, **FAST)
    torch.testing.assert_close(forward(x, mode="full").cov, net(x, mode="full").cov)
    x[2, 1] = float("inf")
    with pytest.raises(ValueError, match="input contains NaN or Inf"):
        forward(x)


def test_lightning_modules_compile_option():
    assert compile_options(False) is None and compile_options(True) == {}
    assert compile_options("reduce-overhead") == {"mode": "reduce-overhead"}
    for bad in ("fast", 1, None):
        with pytest.raises(ValueError, match="compile must be a bool"):
            DVIRegressor(in_features=3, hidden=[4], compile=bad)  # type: ignore[arg-type]
    clf = DVIClassifier(in_features=3, num_classes=3, hidden=[4], compile="reduce-overhead")
    assert clf.hparams["compile"] == "reduce-overhead"
    torch.manual_seed(0)
    x, y = torch.randn(32, 3), torch.randn(32)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)
    model = DVIRegressor(in_features=3, hidden=[4], num_data=32, compile=dict(FAST))
    cpu_trainer(max_epochs=2, enable_checkpointing=False).fit(model, data)
    compiled = model.__dict__["_compiled_elbo_fn"]  # the compiled step was used
    assert compiled.mode == "full"
    terms = model._elbo((x[:16], y[:16]), 1.0, "val")
    y_net = model._network_targets(y[:16])  # the regressor standardises raw targets
    expected = elbo(model.net, model.likelihood, model.prior, x[:16], y_net, 32)
    torch.testing.assert_close(terms.loss, expected.loss)
