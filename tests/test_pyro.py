"""The Pyro front-end: DeterministicGuide + DeterministicELBO on unchanged tutorial models."""

from __future__ import annotations

import math
import warnings

import pyro
import pyro.distributions as dist
import pytest
import torch
from pyro.infer import SVI, Predictive, Trace_ELBO, TraceMeanField_ELBO
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi.data.toy import make_toy_heteroscedastic
from lightning_dvi.priors import EmpiricalBayes
from lightning_dvi.priors.functional import gaussian_kl, optimal_variance
from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide

pytestmark = pytest.mark.usefixtures("pyro_state")


class BNN(PyroModule):
    """The tutorial BNN: PyroModule[nn.Linear] + PyroSample priors, relu, a noise latent."""

    def __init__(self, hidden=(16,), noise="uniform", activation=nn.functional.relu, n=None):
        super().__init__()
        sizes = list(zip((1, *hidden), (*hidden, 1), strict=True))
        self.layers = PyroModule[nn.ModuleList]([PyroModule[nn.Linear](i, o) for i, o in sizes])
        for layer, (i, o) in zip(self.layers, sizes, strict=True):
            layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([o, i]).to_event(2))
            layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([o]).to_event(1))
        self.noise, self.activation, self.n = noise, activation, n

    def forward(self, x, y=None, idx=None, batch_size=None):
        h = x
        for layer in self.layers[:-1]:
            h = self.activation(layer(h))
        mu = self.layers[-1](h).squeeze(-1)
        sigma = {
            "fixed": lambda: 1.0,
            "uniform": lambda: pyro.sample("sigma", dist.Uniform(0.0, 1.0)),
            "gamma": lambda: pyro.sample("sigma", dist.Gamma(2.0, 4.0)),
            "lognormal": lambda: pyro.sample("sigma", dist.LogNormal(-1.0, 0.5)),
            "halfnormal": lambda: pyro.sample("sigma", dist.HalfNormal(1.0)),
        }[self.noise]()
        n = self.n or x.shape[0]
        with pyro.plate("data", n, subsample=idx, subsample_size=batch_size) as i:
            if idx is None and batch_size is None:
                i = slice(None)
            pyro.sample("obs", dist.Normal(mu[i], sigma), obs=None if y is None else y[i])
        return mu


def toy(n=64, seed=0):
    return make_toy_heteroscedastic(n, seed=seed)


def test_one_hidden_layer_loss_equals_trace_mean_field_expectation():
    # One hidden layer: diag moments are exact per data point, so DVI = E[TraceMeanField_ELBO].
    # A fixed subsample of 20 out of N=100 also checks the plate scale (5x) on both sides.
    x, y = torch.randn(20, 1), torch.randn(20)
    idx = torch.arange(20)
    model = BNN(noise="fixed", n=100)
    guide = DeterministicGuide(model, init_scale=0.2)
    dvi = DeterministicELBO().loss(model, guide, x, y, idx)
    mc = torch.tensor([TraceMeanField_ELBO().loss(model, guide, x, y, idx) for _ in range(1500)])
    se = mc.std().item() / math.sqrt(len(mc))
    assert abs(dvi - mc.mean().item()) < 4 * se, (dvi, mc.mean().item(), se)
    # Dropping the variance would move the loss by far more than the tolerance.
    assert 4 * se < 0.05 * abs(dvi)


def test_loss_has_zero_variance_without_non_network_latents():
    x, y = toy(32)
    model = BNN(noise="fixed")
    guide = DeterministicGuide(model)
    losses = {DeterministicELBO().loss(model, guide, x, y) for _ in range(5)}
    assert len(losses) == 1


def test_loss_std_at_most_a_fifth_of_trace_elbo():
    x, y = toy(64)
    model = BNN(noise="uniform")
    guide = DeterministicGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), DeterministicELBO())
    for _ in range(100):
        svi.step(x, y)
    det = torch.tensor([DeterministicELBO().loss(model, guide, x, y) for _ in range(40)])
    mc = torch.tensor([Trace_ELBO().loss(model, guide, x, y) for _ in range(40)])
    assert det.std() <= 0.2 * mc.std(), (det.std(), mc.std())


@pytest.mark.parametrize("noise", ["uniform", "gamma", "lognormal", "halfnormal"])
def test_unchanged_tutorial_model_trains_with_any_noise_prior(noise):
    x, y = toy(128)
    model = BNN(noise=noise)
    guide = DeterministicGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), DeterministicELBO())
    losses = [svi.step(x, y, None, 32) for _ in range(60)]  # subsampled plate
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-10:]) < sum(losses[:10])
    assert "sigma" not in guide.weight_sites and len(guide.weight_sites) == 4


def test_predictive_shapes_and_fit_and_guide_api():
    x, y = toy(200)
    model = BNN(hidden=(32,), noise="uniform")
    guide = DeterministicGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), DeterministicELBO())
    for _ in range(400):
        svi.step(x, y)
    samples = Predictive(model, guide=guide, num_samples=50)(x)
    assert samples["obs"].shape == (50, 200)
    assert samples["layers.0.weight"].shape[-2:] == (32, 1)
    assert samples["sigma"].numel() == 50
    mu = Predictive(model, guide=guide, num_samples=50, return_sites=["_RETURN"])(x)["_RETURN"]
    rmse = (mu.mean(0) - y).square().mean().sqrt()
    assert rmse < 0.5 * y.std()
    median = guide.median()
    loc, _ = guide._get_loc_and_scale("layers.0.weight")
    assert torch.equal(median["layers.0.weight"], loc.detach())
    assert 0 < median["sigma"] < 1
    q = guide.quantiles([0.1, 0.9])
    assert (q["layers.1.bias"][0] < q["layers.1.bias"][1]).all()
    assert "DeterministicGuide.locs.layers.0.weight" in pyro.get_param_store()


def test_svi_step_updates_every_guide_parameter():
    x, y = toy(32)
    model = BNN(noise="uniform")
    guide = DeterministicGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.01}), DeterministicELBO())
    svi.step(x, y)
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    svi.step(x, y)
    after = dict(pyro.get_param_store().items())
    assert len(before) == 2 * (len(guide.weight_sites) + 1)
    assert all(not torch.equal(before[k], after[k].detach()) for k in before)


def test_empirical_bayes_replaces_zero_mean_priors_by_their_optimum():
    x, y = toy(32)
    model = BNN(noise="fixed")
    guide = DeterministicGuide(model)
    fixed = DeterministicELBO().loss(model, guide, x, y)
    with_eb = DeterministicELBO(prior=EmpiricalBayes(alpha=1.0, beta=10.0)).loss(model, guide, x, y)
    delta = 0.0
    for name in guide.weight_sites:
        loc, scale = guide._get_loc_and_scale(name)
        s = optimal_variance(loc, scale, 1.0, 10.0)
        delta += (gaussian_kl(loc, scale, s) - gaussian_kl(loc, scale, 1.0)).item()
    assert with_eb - fixed == pytest.approx(delta, rel=1e-4, abs=1e-3)
    with pytest.raises(ValueError, match="in_graph"):
        DeterministicELBO(prior=EmpiricalBayes(mode="buffer"))


def test_elbo_module_lightning_style_with_module_local_params():
    x, y = toy(64)
    with pyro.settings.context(module_local_params=True):
        model = BNN(noise="uniform")
        guide = DeterministicGuide(model)
        elbo = DeterministicELBO()(model, guide)
        elbo(x, y)  # data-dependent initialisation creates the guide's parameters
        optim = torch.optim.Adam(elbo.parameters(), lr=0.02)
        losses = []
        for _ in range(60):
            optim.zero_grad()
            loss = elbo(x, y)
            loss.backward()
            optim.step()
            losses.append(loss.item())
        assert len(pyro.get_param_store()) == 0  # parameters live in the module only
    assert sum(losses[-10:]) < sum(losses[:10])


def test_masks_deterministic_sites_and_independent_obs_are_handled():
    x, y = toy(40)
    keep = torch.arange(40) % 3 != 0

    def make(masked):
        layer = PyroModule[nn.Linear](1, 1)
        layer.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 1]).to_event(2))
        layer.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))

        def model(x, y=None):
            mu = pyro.deterministic("mu", layer(x))  # [N, 1]
            with pyro.plate("data", x.shape[0]):
                d = dist.Normal(mu, 0.5).to_event(1)
                pyro.sample("obs", d.mask(keep) if masked else d, obs=y.unsqueeze(-1))

        return model

    masked = make(masked=True)
    pyro.set_rng_seed(3)
    guide = DeterministicGuide(masked)
    loss_masked = DeterministicELBO().loss(masked, guide, x, y)
    subset = make(masked=False)
    # Same posterior (same site names and init seed), data restricted to the kept points.
    pyro.clear_param_store()
    pyro.set_rng_seed(3)
    guide_subset = DeterministicGuide(subset)
    loss_subset = DeterministicELBO().loss(subset, guide_subset, x[keep], y[keep])
    assert loss_masked == pytest.approx(loss_subset, rel=1e-5)


def test_named_guides_keep_their_own_parameters():
    # Two guides of one model in one param store (a diag and a full guide side by side): with
    # their own names, training one leaves the other's parameters untouched.
    x, y = toy(32)
    model = BNN(noise="fixed")
    diag = DeterministicGuide(model, name="diag_guide")
    full = DeterministicGuide(model, "full", name="full_guide")
    svis = [SVI(model, g, pyro.optim.Adam({"lr": 0.05}), DeterministicELBO()) for g in (diag, full)]
    for svi in svis:
        svi.step(x, y)
    keys = list(pyro.get_param_store())
    assert len(keys) == 2 * 2 * len(diag.weight_sites)
    assert all(
        k.startswith(("diag_guide.locs.", "diag_guide.scales.")) for k in keys[: len(keys) // 2]
    )
    assert all(
        k.startswith(("full_guide.locs.", "full_guide.scales.")) for k in keys[len(keys) // 2 :]
    )
    before = {k: v.detach().clone() for k, v in pyro.get_param_store().items()}
    for _ in range(3):
        svis[0].step(x, y)
    after = dict(pyro.get_param_store().items())
    assert all(torch.equal(before[k], after[k].detach()) for k in keys if k.startswith("full_"))
    assert not any(torch.equal(before[k], after[k].detach()) for k in keys if k.startswith("diag_"))
    with pytest.raises(ValueError, match="non-empty string"):
        DeterministicGuide(model, name="")


def test_a_second_guide_with_the_same_prefix_warns_that_they_share():
    x, y = toy(32)
    model = BNN(noise="fixed")
    first = DeterministicGuide(model)
    svi = SVI(model, first, pyro.optim.Adam({"lr": 0.05}), DeterministicELBO())
    for _ in range(3):
        svi.step(x, y)
    second = DeterministicGuide(model, "full")
    with pytest.warns(UserWarning, match="share their parameters"):
        second.moment_posteriors(x, y)
    # Pyro's param store returns the first guide's trained values to the second.
    for name in first.weight_sites:
        with torch.no_grad():
            assert torch.equal(
                first._get_loc_and_scale(name)[0], second._get_loc_and_scale(name)[0]
            )
    # A cleared store (a deliberate replacement) or a guide of its own name does not warn.
    pyro.clear_param_store()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        DeterministicGuide(model).moment_posteriors(x, y)
        DeterministicGuide(model, name="other").moment_posteriors(x, y)


def test_first_cpu_call_keeps_large_buffers_for_reuse_once(monkeypatch):
    # as the Lightning modules at fit start: the allocator policy is applied at the first call
    # with CPU tensors (once per ELBO; reuse_large_allocations itself is once per process)
    import lightning_dvi.pyro.elbo as elbo_module

    calls = []
    monkeypatch.setattr(elbo_module, "reuse_large_allocations", lambda: calls.append(1) or True)
    x, y = toy(32)
    model = BNN(noise="fixed")
    guide = DeterministicGuide(model)
    elbo = DeterministicELBO()
    elbo.loss(model, guide, x, y)
    elbo.loss(model, guide, x, y)
    assert calls == [1]
    assert elbo_module._first_device(((), {"x": [None, x]})) == torch.device("cpu")
    assert elbo_module._first_device(((1, "a"), {"k": None})) is None  # no tensor: left alone
