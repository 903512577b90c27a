"""Pyro code as others write it (issue 23): shape discipline, in-place activations, pretrained
initial means, TyXe's model construction, and one objective per likelihood for both front ends."""

from __future__ import annotations

import pyro
import pyro.distributions as dist
import pytest
import torch
import torch.nn.functional as F
from pyro import poutine
from pyro.infer import SVI, Predictive, Trace_ELBO
from pyro.infer.autoguide import init_to_value
from pyro.nn import PyroModule, PyroParam, PyroSample
from pyro.nn.module import to_pyro_module_
from torch import nn

from lightning_dvi import DVIClassifier, Gaussian, likelihoods
from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide, MomentTensor, init_to_he
from lightning_dvi.pyro.distributions import Categorical


def _blobs(n: int = 120, k: int = 3, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    y = torch.randint(k, (n,), generator=gen)
    centres = 3 * torch.randn(k, 4, generator=gen)
    return centres[y] + torch.randn(n, 4, generator=gen), y


class _Tutorial(PyroModule):
    """The Pyro tutorial classifier; ``squeeze`` left out or ``inplace`` ReLU on request."""

    def __init__(self, k: int = 3, inplace: bool = False, keep_dim: bool = False) -> None:
        super().__init__()
        self.keep_dim = keep_dim
        self.fc1 = PyroModule[nn.Linear](4, 16)
        self.fc1.weight = PyroSample(dist.Normal(0.0, 1.0).expand([16, 4]).to_event(2))
        self.fc1.bias = PyroSample(dist.Normal(0.0, 1.0).expand([16]).to_event(1))
        self.act = nn.ReLU(inplace=inplace)
        self.fc2 = PyroModule[nn.Linear](16, k)
        self.fc2.weight = PyroSample(dist.Normal(0.0, 1.0).expand([k, 16]).to_event(2))
        self.fc2.bias = PyroSample(dist.Normal(0.0, 1.0).expand([k]).to_event(1))

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        out = self.fc2(self.act(self.fc1(x)))
        with pyro.plate("data", x.shape[0]):
            if self.keep_dim:  # a regression output left as [N, 1]
                pyro.sample("obs", dist.Normal(out, 1.0), obs=y)
            else:
                pyro.sample("obs", dist.Categorical(logits=out), obs=y)
        return out


def test_output_of_shape_n_by_1_in_a_plate_raises_before_the_first_step(pyro_state) -> None:
    pyro.clear_param_store()
    x, y = torch.randn(20, 4), torch.randn(20)
    model = _Tutorial(k=1, keep_dim=True)
    guide = DeterministicGuide(model)
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.1}), DeterministicELBO())
    with pytest.raises(ValueError, match="site 'obs'") as info:
        svi.step(x, y)
    text = str(info.value)
    for part in ("(20, 20)", "size 20", "squeeze(-1)", ".to_event(1)", "Trace_ELBO"):
        assert part in text, part
    with pytest.raises(ValueError, match="invalid log_prob shape"):  # the same model, Pyro's way
        SVI(model, pyro.infer.autoguide.AutoNormal(model), pyro.optim.Adam({}), Trace_ELBO()).step(
            x, y
        )
    # no step happened: the guide's means are still the initial ones
    loc = guide.locs.fc1.weight.detach().clone()
    with pytest.raises(ValueError):
        svi.step(x, y)
    torch.testing.assert_close(guide.locs.fc1.weight.detach(), loc)
    with pyro.validation_enabled(False):  # Pyro's validation off: no check, as Trace_ELBO
        DeterministicELBO().loss(model, guide, x, y)


def test_in_place_relu_trains_like_the_out_of_place_one(pyro_state) -> None:
    x, y = _blobs()
    losses = {}
    for inplace in (False, True):
        pyro.clear_param_store()
        pyro.set_rng_seed(0)
        model = _Tutorial(inplace=inplace)
        guide = DeterministicGuide(model)
        svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.02}), DeterministicELBO())
        losses[inplace] = [svi.step(x, y) for _ in range(30)]
    assert losses[True] == losses[False]
    assert losses[True][-1] < 0.7 * losses[True][0]


def test_in_place_activation_updates_the_tensor_it_is_given(pyro_state) -> None:
    x = MomentTensor(torch.randn(5, 3), var=torch.rand(5, 3), sources=("w",))
    ref = F.relu(x)
    for op in (lambda t: F.relu(t, inplace=True), lambda t: t.relu_(), torch.relu_):
        t = MomentTensor(x.dvi_mean, var=x.dvi_var, sources=("w",))
        assert op(t) is t
        torch.testing.assert_close((t.dvi_mean, t.dvi_var), (ref.dvi_mean, ref.dvi_var))


def _pretrained(x: torch.Tensor, y: torch.Tensor, k: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(inplace=True), nn.Linear(16, k))
    optim = torch.optim.Adam(net.parameters(), lr=0.05)
    for _ in range(150):
        optim.zero_grad()
        F.cross_entropy(net(x), y).backward()
        optim.step()
    return net


def _accuracy(logits: torch.Tensor, y: torch.Tensor) -> float:
    return (logits.argmax(-1) == y).float().mean().item()


def test_init_loc_fn_sets_pretrained_weight_means(pyro_state) -> None:
    x, y = _blobs()
    net = _pretrained(x, y)
    torch_acc = _accuracy(net(x), y)
    values = {
        "fc1.weight": net[0].weight.detach(),
        "fc1.bias": net[0].bias.detach(),
        "fc2.weight": net[2].weight.detach(),
    }  # fc2.bias left to the fallback
    pyro.clear_param_store()
    model = _Tutorial()
    guide = DeterministicGuide(
        model, init_scale=1e-4, init_loc_fn=init_to_value(values=values, fallback=init_to_he)
    )
    guide(x, y)  # builds the guide
    median = guide.median()
    for name, value in values.items():
        torch.testing.assert_close(median[name], value)
    torch.testing.assert_close(median["fc2.bias"], torch.zeros(3))  # init_to_he: zero biases
    logits = Predictive(model, guide=guide, num_samples=20, return_sites=["_RETURN"])(x)
    # before any step, the posterior predictive is the pretrained network's
    assert _accuracy(logits["_RETURN"].mean(0), y) == pytest.approx(torch_acc, abs=1e-9)
    assert torch_acc > 0.9


def test_default_initialisation_is_he_for_weights_and_zero_for_biases(pyro_state) -> None:
    pyro.clear_param_store()
    torch.manual_seed(0)
    model = _Tutorial()
    guide = DeterministicGuide(model)
    guide(torch.randn(8, 4), torch.zeros(8, dtype=torch.long))
    median = guide.median()
    assert median["fc1.bias"].abs().max() == 0
    assert median["fc1.weight"].std().item() == pytest.approx((2 / 4) ** 0.5, rel=0.35)


# ---------------------------------------------------------------- TyXe's way of building models
class _TyXeStylePrior:
    """What ``tyxe.priors.IIDPrior(dist.Normal(0, 1)).apply_(net)`` does to a PyroModule."""

    def apply_(self, net: nn.Module) -> None:
        for _, module in net.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                prior = dist.Normal(0.0, 1.0).expand(param.shape).to_event(param.dim())
                setattr(module, name, PyroSample(prior))


class _TyXeStyleBNN(PyroModule):
    """``tyxe.VariationalBNN(net, prior, tyxe.likelihoods.Categorical(N))``: its ``model``."""

    def __init__(self, net: nn.Module, dataset_size: int) -> None:
        super().__init__("")
        self.net = net
        to_pyro_module_(self.net)
        _TyXeStylePrior().apply_(self.net)
        self.dataset_size = dataset_size

    def model(self, x: torch.Tensor, obs: torch.Tensor | None = None) -> torch.Tensor:
        predictions = self.net(x)
        # tyxe.likelihoods.Likelihood.forward: a plate whose subsample is the predictions
        with pyro.plate("data_plate", subsample=predictions, size=self.dataset_size):
            pyro.sample("data", dist.Categorical(logits=predictions), obs=obs)
        return predictions


def test_tyxe_style_model_with_pretrained_initializer(pyro_state) -> None:
    x, y = _blobs(n=150)
    net = _pretrained(x, y)
    torch_acc = _accuracy(net(x), y)
    # tyxe.guides.PretrainedInitializer.from_net(net, prefix="net")
    values = {name: p.detach().clone() for name, p in net.named_parameters("net")}
    pretrained = lambda site: values[site["name"]]  # noqa: E731
    pyro.clear_param_store()
    bnn = _TyXeStyleBNN(net, dataset_size=len(x))
    guide = DeterministicGuide(bnn.model, init_scale=1e-4, init_loc_fn=pretrained)
    svi = SVI(bnn.model, guide, pyro.optim.Adam({"lr": 1e-3}), DeterministicELBO())
    guide(x, y)
    assert set(guide.weight_sites) == set(values)
    with poutine.condition(data=guide.median()):  # the posterior means are the pretrained net
        assert _accuracy(bnn.model(x), y) == pytest.approx(torch_acc, abs=1e-9)
    first = svi.step(x, y)
    for _ in range(200):
        last = svi.step(x, y)
    assert last < first
    with poutine.condition(data=guide.median()):
        assert _accuracy(bnn.model(x), y) >= torch_acc - 0.02
    true = torch.tensor([Trace_ELBO().loss(bnn.model, guide, x, y) for _ in range(100)]).mean()
    det = DeterministicELBO().loss(bnn.model, guide, x, y)
    assert true.item() <= det <= 1.05 * true.item() + 1.0  # never optimistic, and close


# ------------------------------------------------------ one expected log-likelihood per site kind
def test_categorical_site_calls_the_classifier_objective(pyro_state) -> None:
    gen = torch.Generator().manual_seed(1)
    mean, var = torch.randn(6, 4, generator=gen), torch.rand(6, 4, generator=gen) * 3
    y = torch.randint(4, (6,), generator=gen)
    site = Categorical(logits=MomentTensor(mean, var=var)).expected_log_prob(y)
    clf = DVIClassifier(in_features=2, num_classes=4, hidden=[4], num_data=6)
    lightning = clf.likelihood.expected_log_prob(Gaussian(mean, var=var), y)
    torch.testing.assert_close(site, lightning, rtol=0, atol=0)
    assert clf.likelihood.method == likelihoods.Categorical(4).method == "tight"


@pytest.mark.parametrize(
    ("site", "match"),
    [
        # probs=sigmoid(f) is the logits form (test_pyro_links.py); other probs are refused
        (
            lambda f: dist.Bernoulli(probs=(torch.tanh(f) + 1.0) / 2.0),
            r"not torch.sigmoid of the network output.*probs=torch.sigmoid\(f\).*logits=f",
        ),
        # softplus is a registered activation (issue 28): its output is Gaussian, not a log-rate
        (lambda f: dist.Poisson(rate=F.softplus(f)), r"rate other than exp\(network output\)"),
        (lambda f: dist.Poisson(rate=f.exp() + 1.0), "exp"),
    ],
)
def test_unsupported_binary_and_count_sites_name_the_fix(pyro_state, site, match) -> None:
    pyro.clear_param_store()
    lin = PyroModule[nn.Linear](4, 1)
    lin.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, 4]).to_event(2))
    lin.bias = PyroParam(torch.zeros(1))

    def model(x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        f = lin(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            pyro.sample("obs", site(f), obs=y)

    x = torch.randn(8, 4)
    guide = DeterministicGuide(model)
    with pytest.raises(NotImplementedError, match=match):
        DeterministicELBO().loss(model, guide, x, torch.ones(8))
