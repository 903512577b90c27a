"""A weight layer and an activation written outside the package, the way a user would.

Neither subclasses a library weight layer nor is listed anywhere in the library: the weight layer
subclasses the public :class:`~lightning_dvi.nn.WeightLayer` and writes two paths, its moments
and its given-weights path (plus ``parameter_groups``, :class:`~lightning_dvi.nn.HasPosterior`);
the activation is one registry entry. They get every mode (``sample`` and ``local`` derived by
the base class), the KL term, empirical Bayes, training, the predictive, conversion from torch,
export and Pyro (the moment pass, ``SVI`` with ``DeterministicELBO``, ``Predictive``) without
any library edit.
"""

from __future__ import annotations

import math

import lightning as L
import pyro
import pytest
import torch
import torch.nn.functional as F
from conformance import LayerCase, LayerConformance
from pyro import poutine
from pyro.nn import PyroModule
from torch import Tensor, nn

from lightning_dvi import DVIRegressor, Gaussian
from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.nn import (
    BayesLinear,
    ParameterGroup,
    ReLU,
    Sequential,
    WeightLayer,
    bayes_layers,
    export_predictive,
    from_torch,
    parameter_groups,
    posterior_moments,
    register_activation,
    register_layer,
)
from lightning_dvi.nn import registry as R
from lightning_dvi.priors import EmpiricalBayes, GaussianPrior
from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide, PyroBayesNet
from lightning_dvi.pyro.messenger import MomentPassMessenger


# --------------------------------------------------------------- the user's code
class TorchGain(nn.Module):
    """The user's deterministic torch twin of :class:`BayesGain`."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.linspace(0.5, 1.5, features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


def _convert_gain(module, options):
    layer = BayesGain(module.weight.numel())
    with torch.no_grad():
        layer.loc.copy_(module.weight)
        if options.scale_fraction == 0:  # a point mass: the torch layer itself
            layer.raw_scale.fill_(-float("inf"))
    return layer


@register_layer("_user_gain", kind="weight", torch_modules=(TorchGain,), convert=_convert_gain)
class BayesGain(WeightLayer):
    r"""``h = a * w`` with one Gaussian gain per unit, :math:`w_i \sim \mathcal N(\mu_i, \sigma_i^2)`."""

    image_output = None

    def __init__(self, features: int) -> None:
        super().__init__()
        self.loc = nn.Parameter(torch.ones(features))
        self.raw_scale = nn.Parameter(torch.full((features,), -2.0))
        self.register_buffer("prior_variance", torch.tensor(1.0))

    def parameter_groups(self) -> list[ParameterGroup]:
        scale = F.softplus(self.raw_scale)
        return [ParameterGroup("weight", self.loc, scale, self.prior_variance, self)]

    def propagate_moments(self, x, mode):
        mu, w_var = posterior_moments(self)["weight"]
        m, v = (x, torch.zeros_like(x)) if isinstance(x, Tensor) else (x.mean, x.var)
        var = v * mu**2 + (m * m + v) * w_var  # Var(a w) for independent a, w
        if isinstance(x, Tensor) or x.cov is None or mode.diag:
            return Gaussian(m * mu, var=var)
        cov = x.cov * mu.unsqueeze(-1) * mu  # Cov(a_i w_i, a_j w_j) = mu_i mu_j Cov(a_i, a_j)
        return Gaussian(m * mu, cov=cov + torch.diag_embed(var - cov.diagonal(0, -2, -1)))

    def propagate_given(self, x, weights):  # x [S, B, D]; a gain [..., D] per draw or shared
        w = weights["weight"]
        return x * (w if w.dim() == 1 else w.unsqueeze(-2))


class TorchNegReLU(nn.Module):
    """The user's torch twin of :class:`NegReLU`."""

    def forward(self, x: Tensor) -> Tensor:
        return -torch.relu(x)


@register_activation("_user_negated_relu", torch_modules=(TorchNegReLU,))
class NegReLU(ReLU):
    """``h = -relu(a)``."""

    _full = staticmethod(lambda m, c: (lambda mm, cc: (-mm, cc))(*ReLU._full(m, c)))
    _diag = staticmethod(lambda m, v: (lambda mm, vv: (-mm, vv))(*ReLU._diag(m, v)))
    _slope = staticmethod(lambda m, v: -ReLU._slope(m, v))

    def elementwise(self, x: Tensor) -> Tensor:
        return -torch.relu(x)


# --------------------------------------------------------------- the checks
def _net() -> Sequential:
    torch.manual_seed(0)
    return Sequential(
        BayesLinear(2, 4, init_scale=0.3), NegReLU(), BayesGain(4), BayesLinear(4, 2)
    ).double()


class TestTheUserLayersConform(LayerConformance):
    """The user's kinds through the same conformance base as the library's."""

    case = LayerCase(
        net=_net,
        x=lambda: torch.randn(4, 2, dtype=torch.float64),
        torch_twin=lambda: nn.Sequential(
            nn.Linear(2, 4), TorchNegReLU(), TorchGain(4), nn.Linear(4, 2)
        ),
        exact_diag=False,  # the gain after a hidden layer sees correlated units
        # written as a Pyro model, the twin's own `x * weight` multiplies two random tensors,
        # which the moment pass refuses (pointing to PyroBayesNet, which runs BayesGain)
        pyro_twin_refused={m: "mul` of two moment-carrying" for m in ("full", "diag")},
    )


@pytest.mark.parametrize("mode", ["full", "diag"])
def test_user_layers_agree_with_monte_carlo(mode):
    net = _net()
    if mode == "diag":  # exact where no covariance is dropped: the gain right after the input
        net = Sequential(BayesGain(2), BayesLinear(2, 2)).double()
    x = torch.randn(3, 2, dtype=torch.float64)
    fidelity = compare_with_monte_carlo(net, x, mode=mode, num_samples=20_000)
    assert fidelity.mean_error < 0.05 and fidelity.std_rel_error < 0.05, fidelity


def test_the_user_weight_layer_is_found_by_protocol_for_kl_and_eb():
    net = _net()
    gain = net[2]
    assert gain in list(bayes_layers(net))
    groups = parameter_groups(net)
    assert sum(g.module is gain for g in groups) == 1
    for prior in (GaussianPrior(1.0), EmpiricalBayes(), EmpiricalBayes(mode="buffer")):
        net.zero_grad()
        prior.kl(net).backward()
        assert gain.raw_scale.grad is not None and gain.raw_scale.grad.abs().sum() > 0
    # the KL sums the user's group like any other
    alone = GaussianPrior(1.0).group_kl(next(g for g in groups if g.module is gain))
    rest = sum(GaussianPrior(1.0).group_kl(g) for g in groups if g.module is not gain)
    torch.testing.assert_close(GaussianPrior(1.0).kl(net), alone + rest)
    # empirical Bayes in buffer mode writes the user's buffer
    EmpiricalBayes(mode="buffer").refresh(net)
    want = EmpiricalBayes().optimal_variance(gain.loc, F.softplus(gain.raw_scale))
    torch.testing.assert_close(gain.prior_variance, want.detach())


def _fit(model, x, y):
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32)
    L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(model, loader)  # fmt: skip


@pytest.mark.parametrize("mode", ["full", "local"])
def test_the_user_layers_train_in_a_dvi_regressor_and_predict(mode):
    net = _net().float()
    x, y = torch.randn(64, 2), torch.randn(64)
    kwargs = {"num_samples": 2} if mode == "local" else {}
    model = DVIRegressor(net=net, lr=1e-2, num_data=64, mode=mode, **kwargs)
    before = net[2].raw_scale.detach().clone()
    _fit(model, x, y)
    assert not torch.equal(before, net[2].raw_scale.detach())
    # the predictive: closed form through the user's moments, Monte Carlo through derived draws
    mean, var = model.predictive(x[:5], "closed_form")
    torch.manual_seed(1)
    mc_mean, mc_var = model.predictive(x[:5], "mc", 4000)
    assert mean.shape == var.shape == (5,) and bool((var > 0).all())
    assert (mean - mc_mean).abs().max() < 0.1 * var.sqrt().max()
    assert ((mc_var / var) - 1).abs().max() < 0.15


@pytest.mark.parametrize("draw", ["sample", "local"])
def test_the_derived_draws_of_the_user_layer_match_its_moments(draw):
    # the layer wrote no sampling code: WeightLayer draws the gain (sample) or each unit (local)
    torch.manual_seed(0)
    layer = BayesGain(3).double()
    with torch.no_grad():
        layer.loc.copy_(torch.tensor([0.5, -1.0, 2.0]))
        layer.raw_scale.copy_(torch.tensor([-1.0, 0.0, -0.5]))
    x = torch.randn(4, 3, dtype=torch.float64)
    f = layer(x, mode=draw, num_samples=40_000)
    ref = layer(x, mode="diag")
    tol = 4 * (ref.var / 40_000).sqrt()
    assert f.shape == (40_000, 4, 3)
    assert bool(((f.mean(0) - ref.mean).abs() < tol).all())
    torch.testing.assert_close(f.var(0), ref.var, rtol=0.05, atol=1e-8)
    if draw == "sample":  # one gain vector per draw, shared by the batch: rows are correlated
        corr = torch.corrcoef(torch.stack([f[:, 0, 0], f[:, 1, 0]]))[0, 1]
        assert corr.abs() > 0.5
    else:  # one draw per example and unit: independent rows
        corr = torch.corrcoef(torch.stack([f[:, 0, 0], f[:, 1, 0]]))[0, 1]
        assert corr.abs() < 0.05


def test_conversion_and_export_of_the_user_layers():
    torch.manual_seed(0)
    torch_net = nn.Sequential(nn.Linear(2, 4), TorchNegReLU(), TorchGain(4), nn.Linear(4, 1))
    net = from_torch(torch_net, scale_fraction=0.0)
    assert [type(m).__name__ for m in net] == ["BayesLinear", "NegReLU", "BayesGain", "BayesLinear"]
    x = torch.randn(5, 2)
    out = net(x, mode="diag")
    with torch.no_grad():
        torch.testing.assert_close(out.mean, torch_net(x))  # the converted net is the torch one
    assert out.var.max() < 1e-10
    for mode in ("diag", "full"):
        predictive = export_predictive(net, mode=mode)
        mean, var = predictive(x)
        ref = net(x, mode=mode)
        torch.testing.assert_close(mean, ref.mean)
        torch.testing.assert_close(var, ref.var)
        program = predictive.export(x)
        torch.testing.assert_close(program.module()(x)[0], mean)


@pytest.mark.usefixtures("pyro_state")
@pytest.mark.parametrize("mode", ["full", "diag"])
def test_the_pyro_pass_makes_sites_for_the_user_layer_and_matches_the_network(mode):
    net = _net()
    pnet = PyroBayesNet(net)
    x = torch.randn(4, 2, dtype=torch.float64)
    trace = poutine.trace(pnet).get_trace(x)
    assert trace.nodes["net.layers.2.weight"]["value"].shape == (4,)
    guide = DeterministicGuide(pnet, mode=mode, init_scale=0.2)
    weights = poutine.trace(guide.moment_posteriors).get_trace(x).nodes["_RETURN"]["value"]
    with pyro.validation_enabled(False):
        out = MomentPassMessenger(weights)(pnet)(x)
    with torch.no_grad():  # the declared network holding the guide's posterior
        for path, layer in pnet._layers:
            for g in layer.parameter_groups():
                loc, scale = guide._get_loc_and_scale(f"net.{path}.{g.name}")
                g.loc.copy_(loc)
                raw = (
                    layer.raw_scale
                    if isinstance(layer, BayesGain)
                    else getattr(layer, f"{g.name}_raw_scale")
                )
                raw.copy_(scale + torch.log(-torch.expm1(-scale)))
        ref = net(x, mode=mode)
    torch.testing.assert_close(out.dvi_mean, ref.mean)
    torch.testing.assert_close(out.dvi_var, ref.var)


def test_registered_user_kinds_are_in_the_one_registry():
    assert any(s.cls is NegReLU for s in R.activation_specs())
    assert R.spec_for_module(TorchGain(2)).cls is BayesGain
    assert any(s.cls is BayesGain for s in R.layer_specs("weight"))


def test_a_user_likelihood_exports_through_its_own_head():
    # export asks the likelihood (Likelihood.export_head); it has no list of likelihood types
    from lightning_dvi.likelihoods import HomoscedasticGaussian, RegressionHead

    class LogNormalMedian(HomoscedasticGaussian):
        def export_head(self, options):
            class Head(RegressionHead):
                name = "median"

                def standardized(self, out):
                    return out.mean[..., 0].exp(), out.var[..., 0]

            return Head(options)

    net = _net()
    x = torch.randn(3, 2, dtype=torch.float64)
    mean, var = export_predictive(net, LogNormalMedian(), mode="full", target_scale=2.0)(x)
    ref = net(x, mode="full")
    torch.testing.assert_close(mean, 2.0 * ref.mean[..., 0].exp())
    torch.testing.assert_close(var, 4.0 * ref.var[..., 0])
    with pytest.raises(ValueError, match="no exportable predictive for Plain"):
        from lightning_dvi.likelihoods import Likelihood

        export_predictive(net, type("Plain", (Likelihood,), {})())


class _GainModel(PyroModule):
    """A Pyro model over the declared network (the user's layer included), with a Normal likelihood."""

    def __init__(self, net):
        super().__init__()
        self.net = PyroBayesNet(net)

    def forward(self, x, y=None):
        mean = self.net(x)[..., 0]
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", pyro.distributions.Normal(mean, 0.3), obs=y)


@pytest.mark.usefixtures("pyro_state")
@pytest.mark.parametrize("mode", ["full", "diag"])
def test_svi_and_predictive_run_the_user_layer(mode):
    torch.manual_seed(0)
    net = Sequential(BayesLinear(2, 4), NegReLU(), BayesGain(4), BayesLinear(4, 1)).double()
    model = _GainModel(net).double()
    x = torch.randn(16, 2, dtype=torch.float64)
    y = torch.sin(x[:, 0]) + 0.1 * torch.randn(16, dtype=torch.float64)
    guide = DeterministicGuide(model, mode=mode, init_scale=0.1)
    svi = pyro.infer.SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), DeterministicELBO())
    losses = [svi.step(x, y) for _ in range(60)]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    site = "net.layers.2.weight"  # the user's gain: a guide site like any library layer's
    assert site in guide.weight_sites
    # Predictive draws weight values, which run the layer's given-weights path
    draws = pyro.infer.Predictive(model, guide=guide, num_samples=7, return_sites=["obs"])(x)
    assert draws["obs"].shape == (7, 16) and bool(torch.isfinite(draws["obs"]).all())
