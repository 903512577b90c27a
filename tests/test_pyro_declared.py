"""Full-covariance DVI through declared networks, and the moment-aware likelihoods."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro import poutine
from pyro.infer import SVI, Predictive
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi.data.toy import make_toy_heteroscedastic
from lightning_dvi.likelihoods import functional as LF
from lightning_dvi.nn import BayesLinear, Heaviside, ReLU, Residual, Sequential, mlp
from lightning_dvi.pyro import (
    Categorical,
    DeterministicELBO,
    DeterministicGuide,
    HeteroscedasticGaussian,
    MomentTensor,
    PyroBayesNet,
)
from lightning_dvi.pyro.messenger import MomentPassMessenger

pytestmark = pytest.mark.usefixtures("pyro_state")


def moment_pass(model, guide, *args):
    """The model's return value in a moment pass with the guide's current posterior."""
    weights = poutine.trace(guide.moment_posteriors).get_trace(*args).nodes["_RETURN"]["value"]
    with pyro.validation_enabled(False):
        return MomentPassMessenger(weights)(model)(*args)


def _inverse_softplus(s: torch.Tensor) -> torch.Tensor:
    return s + torch.log(-torch.expm1(-s))


@pytest.mark.parametrize("mode", ["full", "diag"])
def test_declared_residual_network_matches_lightning_dvi_nn(mode):
    # The Pyro moment pass must reproduce the declared modules' own propagation (skip
    # connections included) when the modules hold the guide's posterior.
    net = Sequential(
        BayesLinear(3, 6),
        Residual(ReLU(), BayesLinear(6, 6)),
        Residual(Heaviside(), BayesLinear(6, 6), ReLU(), BayesLinear(6, 6)),
        ReLU(),
        BayesLinear(6, 2),
    )
    pnet = PyroBayesNet(net)
    x = torch.randn(7, 3)
    guide = DeterministicGuide(pnet, mode=mode, init_scale=0.3)
    out = moment_pass(pnet, guide, x)
    with torch.no_grad():
        for path, layer in pnet._layers:
            loc, scale = guide._get_loc_and_scale(f"net.{path}.weight")
            layer.weight_loc.copy_(loc)
            layer.weight_raw_scale.copy_(_inverse_softplus(scale))
            loc, scale = guide._get_loc_and_scale(f"net.{path}.bias")
            layer.bias_loc.copy_(loc)
            layer.bias_raw_scale.copy_(_inverse_softplus(scale))
        ref = net(x, mode=mode)
    assert isinstance(out, MomentTensor)
    torch.testing.assert_close(out.dvi_mean, ref.mean, rtol=1e-4, atol=1e-5)
    if mode == "full":
        torch.testing.assert_close(out.dvi_cov, ref.cov, rtol=1e-4, atol=1e-5)
    else:
        torch.testing.assert_close(out.dvi_var, ref.var, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["full", "diag"])
def test_declared_heteroscedastic_model_trains_and_predicts(mode):
    x, y = make_toy_heteroscedastic(128)
    net = PyroBayesNet(mlp(1, [16, 16], 2, residual=True), prior_scale=1.0)

    def model(x, y=None):
        out = net(x)
        with pyro.plate("data", x.shape[0], subsample_size=32) as idx:
            obs = None if y is None else y[idx]
            pyro.sample("obs", HeteroscedasticGaussian(out[idx]), obs=obs)

    guide = DeterministicGuide(model, mode=mode)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), DeterministicELBO())
    losses = [svi.step(x, y) for _ in range(80)]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) < sum(losses[:10])
    samples = Predictive(model, guide=guide, num_samples=7)(x)
    assert samples["obs"].shape == (7, 32)
    assert samples["net.layers.1.branch.layers.1.weight"].shape[-2:] == (16, 16)


class TwoLayer(PyroModule):
    def __init__(self, hidden):
        super().__init__()
        sizes = list(zip((2, *hidden), (*hidden, 1), strict=True))
        self.layers = PyroModule[nn.ModuleList]([PyroModule[nn.Linear](i, o) for i, o in sizes])
        for layer, (i, o) in zip(self.layers, sizes, strict=True):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([o, i]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([o]).to_event(1))

    def forward(self, x, y=None):
        h = x
        for layer in self.layers[:-1]:
            h = nn.ReLU()(layer(h))
        mu = self.layers[-1](h).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", dist.Normal(mu, 0.5), obs=y)
        return mu


def test_full_mode_on_tutorial_model_equals_diag_for_one_hidden_layer_only():
    x, y = torch.randn(16, 2), torch.randn(16)
    losses = {}
    for hidden in [(8,), (8, 8)]:
        model = TwoLayer(hidden)
        for mode in ["diag", "full"]:
            pyro.set_rng_seed(1)
            pyro.clear_param_store()
            guide = DeterministicGuide(model, mode=mode, init_scale=0.3)
            losses[hidden, mode] = DeterministicELBO().loss(model, guide, x, y)
    assert losses[(8,), "full"] == pytest.approx(losses[(8,), "diag"], rel=1e-5)
    assert losses[(8, 8), "full"] != pytest.approx(losses[(8, 8), "diag"], rel=1e-5)


def _random_full_moments(batch, k):
    a = torch.randn(*batch, k, k, dtype=torch.float64) * 0.4
    cov = a @ a.transpose(-1, -2) + 0.05 * torch.eye(k, dtype=torch.float64)
    return torch.randn(*batch, k, dtype=torch.float64), cov


def test_heteroscedastic_expected_log_prob_matches_monte_carlo_with_cross_covariance():
    mean, cov = _random_full_moments((5,), 2)
    y = torch.randn(5, dtype=torch.float64)
    mt = MomentTensor(mean, cov=cov, mode="full")
    closed = HeteroscedasticGaussian(mt).expected_log_prob(y)
    f = torch.distributions.MultivariateNormal(mean, cov).sample((200_000,))
    mc = HeteroscedasticGaussian(f).log_prob(y).mean(0)
    torch.testing.assert_close(closed, mc, rtol=0, atol=0.02)


def test_categorical_expected_log_prob_uses_full_or_diag_covariance():
    mean, cov = _random_full_moments((4,), 3)
    y = torch.tensor([0, 2, 1, 1])
    full = Categorical(logits=MomentTensor(mean, cov=cov, mode="full"))
    diag = Categorical(logits=MomentTensor(mean, cov.diagonal(dim1=-2, dim2=-1)))
    # the Lightning classifier's objective (the tight certified bound), with each covariance
    torch.testing.assert_close(
        full.expected_log_prob(y), LF.categorical_tight_expected_log_prob(mean, cov, y)
    )
    torch.testing.assert_close(
        diag.expected_log_prob(y),
        LF.categorical_tight_expected_log_prob(mean, cov.diagonal(dim1=-2, dim2=-1), y),
    )
    assert full.expand(torch.Size([2, 4])).batch_shape == (2, 4)


def test_likelihoods_are_ordinary_distributions_outside_a_moment_pass():
    out = torch.randn(6, 2)
    het = HeteroscedasticGaussian(out)
    y = torch.randn(6)
    ref = dist.Normal(out[:, 0], (0.5 * out[:, 1]).exp())
    torch.testing.assert_close(het.log_prob(y), ref.log_prob(y))
    torch.testing.assert_close(het.expected_log_prob(y), ref.log_prob(y))
    assert het.sample((3,)).shape == (3, 6)
    assert het.expand(torch.Size([2, 6])).batch_shape == (2, 6)
    logits = torch.randn(6, 4)
    cat = Categorical(logits=logits)
    labels = torch.tensor([0, 1, 2, 3, 0, 1])
    torch.testing.assert_close(
        cat.log_prob(labels), dist.Categorical(logits=logits).log_prob(labels)
    )
    assert cat.sample((5,)).shape == (5, 6)
    assert cat.expand(torch.Size([2, 6])).sample().shape == (2, 6)
    with pytest.raises(ValueError, match=r"\[\.\.\., 2\]"):
        HeteroscedasticGaussian(torch.randn(6, 3))


def test_declared_classifier_in_full_mode_learns():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(90, 2, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    net = PyroBayesNet(mlp(2, [16], 3), name="clf")

    def model(x, y=None):
        logits = net(x)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", Categorical(logits=logits), obs=y)

    guide = DeterministicGuide(model, mode="full")
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.03}), DeterministicELBO())
    for _ in range(150):
        svi.step(x, y)
    pred = Predictive(model, guide=guide, num_samples=30)(x)["obs"]
    assert (pred.mode(0).values == y).float().mean() > 0.85
