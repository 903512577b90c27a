"""Pyro models written with probabilities, and what the moment pass refuses (issue 44, item 6).

``dist.Bernoulli(probs=torch.sigmoid(f))`` (TyXe's ``logit_predictions=False``, a network ending
in ``nn.Sigmoid``) and ``dist.Categorical(probs=torch.softmax(f, -1))`` are the same models as
their logits forms, and the moment pass observes them with the same expected log-likelihood.
Every refusal lists what does work, generated from the op table and the layer registry.
"""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi.nn import BayesLinear, LayerNorm, ReLU, Sequential
from lightning_dvi.nn.registry import _SPECS, register_activation
from lightning_dvi.pyro import (
    Categorical,
    DeterministicELBO,
    DeterministicGuide,
    MomentTensor,
    PyroBayesNet,
)
from lightning_dvi.pyro.dispatch import supported_ops

pytestmark = pytest.mark.usefixtures("pyro_state")


def _bayes_linear(d_in: int, d_out: int) -> PyroModule:
    layer = PyroModule[nn.Linear](d_in, d_out)
    layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([d_out, d_in]).to_event(2))
    layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([d_out]).to_event(1))
    return layer


class _Net(PyroModule):
    """Linear -> ReLU -> Linear, optionally ending in an output module (nn.Sigmoid, ...)."""

    def __init__(self, d_out: int, last: nn.Module | None = None) -> None:
        super().__init__()
        self.l1, self.l2 = _bayes_linear(3, 8), _bayes_linear(8, d_out)
        self.last = last

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        f = self.l2(torch.relu(self.l1(x)))
        return f if self.last is None else self.last(f)


def _losses(site, net_last, n_out, y, mode):
    """The DeterministicELBO loss of ``obs ~ site(net(x))`` for one fixed guide, and its grads."""
    x = torch.randn(len(y), 3, generator=torch.Generator().manual_seed(1))
    pyro.clear_param_store()
    torch.manual_seed(0)
    net = _Net(n_out, net_last)

    def model(x, y=None):
        out = net(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", site(out), obs=y)

    guide = DeterministicGuide(model, mode=mode, init_scale=0.5)
    loss = DeterministicELBO().differentiable_loss(model, guide, x, y)
    loss.backward()
    grads = {k: v.grad.clone() for k, v in pyro.get_param_store().named_parameters()}
    return loss.detach(), grads


@pytest.mark.parametrize("mode", ["diag", "full"])
@pytest.mark.parametrize(
    "probs_site",
    [
        lambda out: dist.Bernoulli(probs=torch.sigmoid(out).squeeze(-1)),  # sigmoid, then shape
        lambda out: dist.Bernoulli(probs=out.squeeze(-1).sigmoid()),
    ],
)
def test_bernoulli_probs_of_sigmoid_is_the_logits_form(mode, probs_site):
    y = torch.tensor([0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    want, want_grads = _losses(lambda f: dist.Bernoulli(logits=f.squeeze(-1)), None, 1, y, mode)
    got, grads = _losses(probs_site, None, 1, y, mode)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grads, want_grads, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["diag", "full"])
def test_a_network_ending_in_nn_sigmoid_observed_by_probs_is_the_logits_form(mode):
    """TyXe's ``logit_predictions=False``: the network's last layer is ``nn.Sigmoid``."""
    y = torch.tensor([[0.0, 1.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0]])

    def logits_site(f):
        return dist.Bernoulli(logits=f).to_event(1)

    def probs_site(p):
        return dist.Bernoulli(probs=p).to_event(1)

    want, _ = _losses(logits_site, None, 2, y, mode)
    got, _ = _losses(probs_site, nn.Sigmoid(), 2, y, mode)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("mode", ["diag", "full"])
@pytest.mark.parametrize(
    ("probs_site", "last"),
    [
        (lambda out: dist.Categorical(probs=torch.softmax(out, -1)), None),
        (lambda p: dist.Categorical(probs=p), nn.Softmax(dim=-1)),
        (lambda out: Categorical(probs=out.softmax(dim=-1)), None),  # lightning_dvi.pyro's
    ],
)
def test_categorical_probs_of_softmax_is_the_logits_form(mode, probs_site, last):
    y = torch.tensor([0, 2, 1, 1, 0, 2])
    want, want_grads = _losses(lambda f: dist.Categorical(logits=f), None, 3, y, mode)
    got, grads = _losses(probs_site, last, 3, y, mode)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(grads, want_grads, rtol=0, atol=0)


def test_the_probs_form_trains_with_svi():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 3, generator=gen)
    y = (x[:, 0] - x[:, 1] > 0).float()
    net = _Net(1, nn.Sigmoid())

    def model(x, y=None):
        p = net(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Bernoulli(probs=p), obs=y)

    guide = DeterministicGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), DeterministicELBO())
    losses = [svi.step(x, y) for _ in range(30)]
    assert losses[-1] < 0.7 * losses[0], losses


def _refusal(op) -> str:
    x = MomentTensor(torch.zeros(2, 3), var=torch.ones(2, 3), sources=("w",))
    with pytest.raises(NotImplementedError) as err:
        op(x)
    return str(err.value)


def test_a_refusal_names_the_op_and_lists_every_supported_op():
    text = _refusal(torch.sin)
    assert text.startswith("`torch.sin` on a moment-carrying tensor is not supported")
    listed = supported_ops()
    for group in ("layers", "pooling", "normalization", "activations", "shape ops"):
        assert group in listed
        for name in listed[group]:
            assert name in text, (group, name)
    # what users asked for by name: conv and both poolings, the norms, cat, the probs links
    for name in ("conv2d", "avg_pool2d", "max_pool2d", "batch_norm", "group_norm", "cat"):
        assert name in text
    assert "PyroBayesNet" in text and "Trace_ELBO" in text


def test_the_supported_ops_come_from_the_registry():
    """A kind registered later is listed (and works) with no Pyro-side edit."""

    def doubled(x):  # stands in for a user's torch function
        return 2 * x

    assert "doubled" not in _refusal(torch.sin)

    @register_activation("_doc_doubled", torch_functions=(doubled,))
    class _Doubled(ReLU):
        pass

    try:
        assert "doubled" in supported_ops()["activations"]
        assert "doubled" in _refusal(torch.sin)
    finally:
        _SPECS.pop("_doc_doubled")


def test_bernoulli_probs_not_from_sigmoid_is_refused_naming_both_fixes():
    net = _Net(1)

    def model(x, y=None):
        p = (torch.tanh(net(x).squeeze(-1)) + 1.0) / 2.0
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Bernoulli(probs=p), obs=y)

    x, y = torch.randn(4, 3), torch.ones(4)
    with pytest.raises(NotImplementedError) as err:
        DeterministicELBO().loss(model, DeterministicGuide(model), x, y)
    text = str(err.value)
    assert "Bernoulli(probs=p) whose p is not torch.sigmoid" in text
    assert "probs=torch.sigmoid(f)" in text and "logits=f" in text


def test_cat_of_independent_moments_keeps_the_block_diagonal_covariance():
    a = MomentTensor(torch.zeros(2, 2), cov=torch.eye(2).expand(2, 2, 2) * 2.0, mode="full",
                     sources=("a",))  # fmt: skip
    b = MomentTensor(torch.ones(2, 1), var=torch.full((2, 1), 3.0), mode="full", sources=("b",))
    out = torch.cat([a, b], -1)
    want = torch.diag(torch.tensor([2.0, 2.0, 3.0])).expand(2, 3, 3)
    torch.testing.assert_close(out.dvi_cov, want)
    torch.testing.assert_close(out.dvi_mean, torch.tensor([[0.0, 0.0, 1.0]] * 2))
    with pytest.raises(NotImplementedError, match="both depend on weight site"):
        torch.cat([a, a], -1)  # their cross-covariance is not tracked
    both = torch.cat([a, a], 0)  # rows: per-example covariances, exact
    torch.testing.assert_close(both.dvi_cov, torch.cat([a.dvi_cov, a.dvi_cov]))


def test_pyro_bayes_net_trains_the_normalization_gains_as_pyro_params():
    net = Sequential(BayesLinear(3, 6), LayerNorm(6), ReLU(), BayesLinear(6, 1)).float()
    pnet = PyroBayesNet(net)

    def model(x, y=None):
        f = pnet(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(f, 0.3), obs=y)

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 3, generator=gen)
    y = x.sum(-1)
    before = net.layers[1].weight.detach().clone()
    svi = SVI(model, DeterministicGuide(model), pyro.optim.Adam({"lr": 0.05}), DeterministicELBO())
    for _ in range(5):
        svi.step(x, y)
    assert "net.layers.1.weight" in pyro.get_param_store()
    assert not torch.equal(net.layers[1].weight.detach(), before)  # trained in place


def test_pyro_bayes_net_refuses_a_parameter_that_is_neither_posterior_nor_point():
    class Gained(ReLU):
        def __init__(self):
            super().__init__()
            self.gain = nn.Parameter(torch.ones(()))

    with pytest.raises(NotImplementedError) as err:
        PyroBayesNet(Sequential(BayesLinear(2, 2), Gained(), BayesLinear(2, 1)))
    text = str(err.value)
    assert "declared module Gained" in text and "'gain'" in text
    assert "HasPosterior" in text and "point_parameters" in text and "max_pool2d" in text
