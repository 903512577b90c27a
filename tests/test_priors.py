"""Priors against torch.distributions KLs and a direct scipy minimisation of the EB objective."""

import math

import numpy as np
import pytest
import torch
from helpers import posterior_net
from scipy import optimize, stats

from lightning_dvi.nn import BayesLinear, parameter_groups
from lightning_dvi.priors import EmpiricalBayes, GaussianPrior, functional, named_parameter_groups

F64 = torch.float64


def _torch_kl(net: torch.nn.Module, variances: list[float]) -> torch.Tensor:
    total = torch.zeros((), dtype=F64)
    for g, s in zip(parameter_groups(net), variances, strict=True):
        q = torch.distributions.Normal(g.loc, g.scale)
        p = torch.distributions.Normal(torch.zeros_like(g.loc), math.sqrt(s))
        total = total + torch.distributions.kl_divergence(q, p).sum()
    return total


def test_gaussian_prior_kl_matches_torch_distributions() -> None:
    net = posterior_net()
    kl = GaussianPrior(0.7).kl(net)
    assert kl.shape == ()
    assert torch.allclose(kl, _torch_kl(net, [0.7] * 6), rtol=1e-12)
    kl.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())


def _eb_objective_minimiser(loc: np.ndarray, scale: np.ndarray, alpha: float, beta: float) -> float:
    """argmin_s KL(q || N(0, s)) - log InvGamma(s; alpha, beta), found numerically over log s."""
    var, mu2, n = scale**2, loc**2, loc.size

    def objective(log_s: float) -> float:
        s = math.exp(log_s)
        kl = 0.5 * np.sum((var + mu2) / s - 1 - np.log(var / s))
        return kl - stats.invgamma.logpdf(s, a=alpha, scale=beta)

    res = optimize.minimize_scalar(
        objective, bounds=(-20, 20), method="bounded", options={"xatol": 1e-12}
    )
    assert res.success
    assert n > 0
    return math.exp(res.x)


@pytest.mark.parametrize(("alpha", "beta"), [(1.0, 10.0), (0.5, 0.01), (3.0, 1.0), (10.0, 0.2)])
def test_eb_optimum_matches_numerical_minimisation(alpha: float, beta: float) -> None:
    gen = torch.Generator().manual_seed(int(alpha * 10 + beta * 100))
    for n in (1, 5, 300):
        loc = torch.randn(n, generator=gen, dtype=F64) * 0.4
        scale = torch.rand(n, generator=gen, dtype=F64) * 0.3 + 1e-3
        s_star = EmpiricalBayes(alpha, beta).optimal_variance(loc, scale)
        s_num = _eb_objective_minimiser(loc.numpy(), scale.numpy(), alpha, beta)
        assert s_star.shape == ()
        assert abs(s_star.item() / s_num - 1) < 1e-4


@pytest.mark.parametrize("mode", ["in_graph", "buffer"])
def test_eb_kl_equals_torch_kl_at_optimum(mode: str) -> None:
    net = posterior_net()
    prior = EmpiricalBayes(alpha=2.0, beta=0.5, mode=mode)
    s_star = [prior.optimal_variance(g.loc, g.scale).item() for g in parameter_groups(net)]
    if mode == "buffer":
        names = prior.refresh(net)
        assert list(names) == [name for name, _ in named_parameter_groups(net)]
        assert list(names) == [
            "layers.0.weight",
            "layers.0.bias",
            "layers.2.weight",
            "layers.2.bias",
            "layers.4.weight",
            "layers.4.bias",
        ]
        assert np.allclose(list(names.values()), s_star, rtol=1e-12)
    kl = prior.kl(net)
    assert torch.allclose(kl, _torch_kl(net, s_star), rtol=1e-10)
    # The buffers hold s* in both modes, so checkpoints carry the fitted prior.
    state = net.state_dict()
    assert math.isclose(state["layers.0.weight_prior_variance"].item(), s_star[0], rel_tol=1e-12)
    assert math.isclose(state["layers.4.bias_prior_variance"].item(), s_star[5], rel_tol=1e-12)


def test_in_graph_differentiates_through_s_star_and_buffer_mode_does_not() -> None:
    net = posterior_net()
    in_graph, buffer = EmpiricalBayes(mode="in_graph"), EmpiricalBayes(mode="buffer")
    buffer.refresh(net)
    assert torch.allclose(in_graph.kl(net), buffer.kl(net), rtol=1e-12)
    layer = net[0]
    grads = []
    for prior in (in_graph, buffer):
        net.zero_grad()
        prior.kl(net).backward()
        grads.append(layer.weight_loc.grad.clone())
    # Closed forms of the two gradients for the first weight group, mu_i/s* vs (mu_i/s*)(1 - c).
    g = parameter_groups(net)[0]
    s = in_graph.optimal_variance(g.loc, g.scale).detach()
    n = g.loc.numel()
    d = n + 2 * in_graph.alpha + 2
    dkl_ds = 0.5 * (n / s - ((g.scale**2 + g.loc**2).sum() / s**2)).detach()
    expected_in_graph = g.loc.detach() / s + dkl_ds * 2 * g.loc.detach() / d
    assert torch.allclose(grads[1], g.loc.detach() / s, rtol=1e-10)
    assert torch.allclose(grads[0], expected_in_graph, rtol=1e-8)


def test_buffer_mode_before_refresh_uses_layer_prior_variance() -> None:
    net = posterior_net()
    assert torch.allclose(EmpiricalBayes(mode="buffer").kl(net), GaussianPrior(1.0).kl(net))


def test_hyperprior_log_prob_matches_scipy() -> None:
    net = posterior_net()
    prior = EmpiricalBayes(alpha=1.5, beta=0.3)
    expected = sum(
        stats.invgamma.logpdf(prior.optimal_variance(g.loc, g.scale).item(), a=1.5, scale=0.3)
        for g in parameter_groups(net)
    )
    assert math.isclose(prior.hyperprior_log_prob(net).item(), expected, rel_tol=1e-10)


def test_functional_gaussian_kl_scalar_and_float32() -> None:
    loc, scale = torch.randn(10), torch.rand(10) + 0.1
    ref = torch.distributions.kl_divergence(
        torch.distributions.Normal(loc, scale), torch.distributions.Normal(0.0, 2.0)
    ).sum()
    got = functional.gaussian_kl(loc, scale, 4.0)
    assert got.dtype == torch.float32
    assert torch.allclose(got, ref, rtol=1e-5)


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: EmpiricalBayes(alpha=0.0), "alpha"),
        (lambda: EmpiricalBayes(alpha=-1.0), "alpha"),
        (lambda: EmpiricalBayes(beta=0.0), "beta"),
        (lambda: EmpiricalBayes(beta=math.nan), "beta"),
        (lambda: EmpiricalBayes(mode="alternating"), "mode"),
        (lambda: GaussianPrior(0.0), "variance"),
        (lambda: GaussianPrior(-2.0), "variance"),
        (lambda: GaussianPrior(math.inf), "variance"),
    ],
)
def test_bad_hyperparameters_raise(make, match) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def test_kl_of_a_net_without_bayes_layers_raises() -> None:
    with pytest.raises(ValueError, match="no BayesLinear"):
        GaussianPrior().kl(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="no BayesLinear"):
        EmpiricalBayes().kl(torch.nn.Sequential())


def test_single_layer_names_and_bias_free_layer() -> None:
    layer = BayesLinear(4, 3, bias=False)
    assert list(EmpiricalBayes(mode="buffer").refresh(layer)) == ["weight"]
    assert EmpiricalBayes().kl(layer).shape == ()
