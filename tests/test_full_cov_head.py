"""The full-covariance head: moments against Monte Carlo, the KL against torch.distributions."""

from __future__ import annotations

import pytest
import torch
from torch.distributions import MultivariateNormal, kl_divergence

from lightning_dvi import Gaussian
from lightning_dvi.moments import full_cov_linear as FC
from lightning_dvi.moments import linear_full
from lightning_dvi.nn import BayesLinear, BayesLinearFullCov, parameter_groups
from lightning_dvi.priors import EmpiricalBayes, GaussianPrior

K, D = 3, 4
P = K * (D + 1)


def _posterior(dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    loc = torch.randn(K, D + 1, generator=g, dtype=dtype)
    tril = torch.randn(P, P, generator=g, dtype=dtype).tril(-1) * 0.2
    tril = tril + torch.diag(torch.rand(P, generator=g, dtype=dtype) * 0.3 + 0.1)
    return loc, tril


def _weight_draws(loc, tril, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    eps = torch.randn(n, P, generator=g, dtype=loc.dtype)
    return loc + (eps @ tril.T).reshape(n, K, D + 1)  # [n, K, D+1]


def _mc_moments(a):
    mean = a.mean(0)
    centred = a - mean
    return mean, torch.einsum("n...k,n...l->...kl", centred, centred) / (a.shape[0] - 1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_deterministic_input_moments_match_monte_carlo(dtype):
    loc, tril = _posterior(dtype)
    x = torch.randn(2, D, dtype=dtype)
    mean, cov = FC.full_cov_linear_deterministic(x, loc, tril)
    n = 200_000
    w = _weight_draws(loc, tril, n)
    a = torch.einsum("bj,nkj->nbk", torch.cat([x, torch.ones(2, 1, dtype=dtype)], -1), w)
    mc_mean, mc_cov = _mc_moments(a)
    scale = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    # 200,000 draws: mean error ~ 0.0022 std, covariance error ~ 0.003 std^2 (6 sigma bound)
    assert ((mc_mean - mean).abs() / scale).max() < 0.015
    norm = scale.unsqueeze(-1) * scale.unsqueeze(-2)
    assert ((mc_cov - cov).abs() / norm).max() < 0.02
    off = cov[..., 0, 1].abs() / norm[..., 0, 1]
    assert off.min() > 0.05  # the logits really are correlated


@pytest.mark.parametrize("diagonal", [True, False])
def test_gaussian_input_moments_match_monte_carlo(diagonal):
    loc, tril = _posterior()
    mu = torch.randn(2, D, dtype=torch.float64)
    if diagonal:
        var = torch.rand(2, D, dtype=torch.float64) + 0.2
        cov_in = torch.diag_embed(var)
        mean, cov = FC.full_cov_linear_gaussian(mu, var, loc, tril, diagonal=True)
    else:
        a = torch.randn(2, D, D, dtype=torch.float64) * 0.5
        cov_in = a @ a.transpose(-1, -2) + 0.1 * torch.eye(D, dtype=torch.float64)
        mean, cov = FC.full_cov_linear_gaussian(mu, cov_in, loc, tril, diagonal=False)
    n = 400_000
    w = _weight_draws(loc, tril, n)
    h = MultivariateNormal(mu, cov_in).sample((n,))  # independent of the weights
    h = torch.cat([h, torch.ones(n, 2, 1, dtype=torch.float64)], -1)
    mc_mean, mc_cov = _mc_moments(torch.einsum("nbj,nkj->nbk", h, w))
    scale = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    norm = scale.unsqueeze(-1) * scale.unsqueeze(-2)
    # 400,000 draws of a product of Gaussians (heavier tails): 5e-3 mean, 2.5e-2 covariance
    assert ((mc_mean - mean).abs() / scale).max() < 0.01
    assert ((mc_cov - cov).abs() / norm).max() < 0.025


def test_a_diagonal_cholesky_factor_is_the_factorised_layer():
    loc, tril = _posterior()
    tril = torch.diag(tril.diagonal())
    var = tril.diagonal().square().reshape(K, D + 1)
    mu = torch.randn(5, D, dtype=torch.float64)
    a = torch.randn(5, D, D, dtype=torch.float64)
    cov_in = a @ a.transpose(-1, -2)
    mean, cov = FC.full_cov_linear_gaussian(mu, cov_in, loc, tril, diagonal=False)
    ref_mean, ref_cov = linear_full(
        mu, cov_in, loc[:, :D], var[:, :D], loc[:, D].contiguous(), var[:, D].contiguous()
    )
    torch.testing.assert_close(mean, ref_mean)
    torch.testing.assert_close(cov, ref_cov)


def _layer(seed=0, dtype=torch.float64):
    torch.manual_seed(seed)
    layer = BayesLinearFullCov(D, K, init_scale=0.3).to(dtype)
    with torch.no_grad():
        layer.tril.normal_(0.0, 0.1)
    return layer


@pytest.mark.parametrize("prior", ["gaussian", "empirical_bayes"])
def test_kl_is_the_full_gaussian_kl(prior):
    layer = _layer()
    if prior == "gaussian":
        kl = GaussianPrior(0.7).kl(layer)
        s_w = s_b = torch.tensor(0.7, dtype=torch.float64)
    else:
        eb = EmpiricalBayes(alpha=2.0, beta=3.0, mode="in_graph")
        kl = eb.kl(layer)
        groups = parameter_groups(layer)
        s_w, s_b = (eb.optimal_variance(g.loc, g.scale).detach() for g in groups)
    prior_var = torch.full((K, D + 1), float(s_w), dtype=torch.float64)
    prior_var[:, D] = s_b
    q = MultivariateNormal(layer.loc.flatten(), scale_tril=layer.scale_tril)
    p = MultivariateNormal(torch.zeros(P, dtype=torch.float64), torch.diag(prior_var.flatten()))
    torch.testing.assert_close(kl, kl_divergence(q, p), rtol=1e-10, atol=1e-10)


def test_empirical_bayes_sees_the_marginal_variances():
    layer = _layer()
    groups = parameter_groups(layer)
    sigma = layer.covariance.diagonal().reshape(K, D + 1)
    torch.testing.assert_close(groups[0].scale.square(), sigma[:, :D])
    torch.testing.assert_close(groups[1].scale.square(), sigma[:, D])
    assert groups[0].correlation_kl is not None and float(groups[0].correlation_kl) > 0


@pytest.mark.parametrize("mode", ["sample", "local"])
def test_sampling_modes_draw_correlated_logits(mode):
    layer = _layer()
    x = torch.randn(2, D, dtype=torch.float64)
    with torch.no_grad():
        ref = layer(x, mode="full")
        torch.manual_seed(3)
        draws = layer(x, mode=mode, num_samples=100_000)
    mc_mean, mc_cov = _mc_moments(draws)
    scale = ref.var.sqrt()
    norm = scale.unsqueeze(-1) * scale.unsqueeze(-2)
    assert ((mc_mean - ref.mean).abs() / scale).max() < 0.03
    assert ((mc_cov - ref.cov).abs() / norm).max() < 0.04


def test_diag_mode_keeps_the_diagonal_and_full_mode_the_correlations():
    layer = _layer()
    x = torch.randn(4, D, dtype=torch.float64)
    full, diag = layer(x, mode="full"), layer(x, mode="diag")
    assert diag.cov is None
    torch.testing.assert_close(diag.var, full.var)
    assert full.cov[:, 0, 1].abs().min() > 0


def test_from_bayes_linear_keeps_the_posterior():
    torch.manual_seed(0)
    linear = BayesLinear(D, K, init_scale=0.2).double()
    layer = BayesLinearFullCov.from_bayes_linear(linear)
    x = torch.randn(3, D, dtype=torch.float64)
    for mode in ("full", "diag"):
        a, b = layer(x, mode=mode), linear(x, mode=mode)
        torch.testing.assert_close(a.mean, b.mean)
        torch.testing.assert_close(a.var, b.var)
    g = Gaussian(x, var=torch.rand(3, D, dtype=torch.float64))
    torch.testing.assert_close(layer(g, mode="full").cov, linear(g, mode="full").cov)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="scale_transform"):
        BayesLinearFullCov(2, 2, scale_transform="relu")
    with pytest.raises(ValueError, match="features must be positive"):
        BayesLinearFullCov(0, 2)
    with pytest.raises(ValueError, match="prior_variance must be finite and positive"):
        BayesLinearFullCov(2, 2, prior_variance=0.0)
    with pytest.raises(ValueError, match="init_scale must be finite and positive"):
        BayesLinearFullCov(2, 2, init_scale=-1.0)
    layer = BayesLinearFullCov(2, 3)
    with pytest.raises(ValueError, match="last dimension 2"):
        layer(torch.randn(4, 5))
    with pytest.raises(ValueError, match="bias: expected shape"):
        layer.set_posterior(torch.zeros(3, 2), torch.ones(3, 2), torch.zeros(2), torch.ones(2))
