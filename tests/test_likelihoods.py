"""Likelihoods against independent oracles: large Monte Carlo and autograd Hessians."""

import math

import numpy as np
import pytest
import torch

from lightning_dvi import Gaussian
from lightning_dvi.likelihoods import (
    Categorical,
    HeteroscedasticGaussian,
    HeteroscedasticPredictive,
    HomoscedasticGaussian,
    Likelihood,
    functional,
)

F64 = torch.float64


def _random_cov(gen: torch.Generator, d: int, scale: float) -> torch.Tensor:
    a = torch.randn(d, d + 2, generator=gen, dtype=F64)
    return scale * (a @ a.T) / (d + 2)


def _mc_gaussian(mean: torch.Tensor, cov: torch.Tensor, n: int, gen: torch.Generator):
    eps = torch.randn(n, mean.shape[-1], generator=gen, dtype=F64)
    return mean + eps @ torch.linalg.cholesky(cov).T


# ---------------------------------------------------------------- heteroscedastic regression
@pytest.mark.parametrize("case", range(5))
def test_heteroscedastic_expected_log_prob_matches_1e6_monte_carlo(case: int) -> None:
    gen = torch.Generator().manual_seed(100 + case)
    u = torch.rand(5, generator=gen, dtype=F64)
    mean = torch.stack([torch.randn((), generator=gen, dtype=F64), u[0] - 0.5])
    sd = torch.stack([0.3 + 0.4 * u[1], 0.2 + 0.3 * u[2]])
    rho = (0.3 + 0.5 * u[3]) * (1 if case % 2 else -1)  # correlated (m, l): Sigma_ml matters
    cov = torch.outer(sd, sd) * torch.tensor([[1, rho], [rho, 1]], dtype=F64)
    y = mean[0] + 0.5 * torch.randn((), generator=gen, dtype=F64)
    samples = _mc_gaussian(mean, cov, 10**6, gen)
    m, log_var = samples[:, 0], samples[:, 1]
    log_p = -0.5 * (math.log(2 * math.pi) + log_var + (y - m) ** 2 * torch.exp(-log_var))
    se = log_p.std() / 1000
    assert se < 2.5e-3  # so 1e-2 is a 4-sigma test
    closed = functional.heteroscedastic_expected_log_prob(
        mean[0], cov[0, 0], mean[1], cov[1, 1], cov[0, 1], y
    )
    assert abs(closed - log_p.mean()) < 1e-2
    # The module agrees with the functional form.
    out = Gaussian(mean[None], cov=cov[None])
    assert torch.allclose(HeteroscedasticGaussian().expected_log_prob(out, y[None])[0], closed)


def test_dropping_sigma_ml_is_measurably_wrong() -> None:
    # Guards against a regression that ignores Sigma_ml: the oracle difference is large here.
    mean_m, mean_l = torch.tensor(0.3, dtype=F64), torch.tensor(-0.5, dtype=F64)
    var_m, var_l, cov_ml = (torch.tensor(v, dtype=F64) for v in (0.5, 0.4, 0.35))
    y = torch.tensor(1.2, dtype=F64)
    full = functional.heteroscedastic_expected_log_prob(mean_m, var_m, mean_l, var_l, cov_ml, y)
    diag = functional.heteroscedastic_expected_log_prob(mean_m, var_m, mean_l, var_l, 0 * cov_ml, y)
    assert abs(full - diag) > 0.3


@pytest.mark.parametrize("case", range(3))
def test_heteroscedastic_predictive_moments_match_monte_carlo(case: int) -> None:
    gen = torch.Generator().manual_seed(200 + case)
    mean = torch.randn(2, generator=gen, dtype=F64) * 0.5
    cov = _random_cov(gen, 2, 0.3)
    samples = _mc_gaussian(mean, cov, 10**6, gen)
    y = samples[:, 0] + torch.exp(samples[:, 1] / 2) * torch.randn(10**6, generator=gen, dtype=F64)
    pred = HeteroscedasticGaussian().predictive(Gaussian(mean[None], cov=cov[None]))
    assert isinstance(pred, HeteroscedasticPredictive)
    closed_var = cov[0, 0] + torch.exp(mean[1] + cov[1, 1] / 2)
    assert torch.allclose(pred.mean[0], mean[0])
    assert torch.allclose(pred.variance[0], closed_var)
    assert abs(y.mean() - mean[0]) < 5 * y.std() / 1000
    assert abs(y.var() / closed_var - 1) < 1e-2
    # the CDF (quadrature over l) against the draws' empirical CDF, 5 Kolmogorov sigmas
    points = y.quantile(torch.tensor([0.001, 0.05, 0.3, 0.5, 0.7, 0.95, 0.999], dtype=F64))
    empirical = (y[:, None] <= points).double().mean(0)
    assert (pred.cdf(points[:, None]).squeeze(-1) - empirical).abs().max() < 5 * 0.5 / 1000
    draws = pred.sample((10**6,))[:, 0]  # its own sampler: the same law
    assert abs(draws.var() / closed_var - 1) < 1e-2
    assert ((draws[:, None] <= points).double().mean(0) - empirical).abs().max() < 5 * 0.71 / 1000


def test_heteroscedastic_exponent_is_formed_in_log_space() -> None:
    # e^{<l>} and e^{Sigma_ll/2} each overflow float32; their ratio does not.
    args = [torch.tensor(v) for v in (0.1, 0.2, 100.0, 200.0, 0.0, 0.3)]
    value = functional.heteroscedastic_expected_log_prob(*args)
    ref = functional.heteroscedastic_expected_log_prob(*[a.double() for a in args])
    assert torch.isfinite(value)
    assert torch.allclose(value.double(), ref, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("full", [True, False])
def test_base_monte_carlo_agrees_with_heteroscedastic_closed_form(dtype, full) -> None:
    gen = torch.Generator().manual_seed(3)
    b = 4
    mean = torch.randn(b, 2, generator=gen, dtype=F64) * 0.5
    cov = torch.stack([_random_cov(gen, 2, 0.2) for _ in range(b)])
    mean, cov = mean.to(dtype), cov.to(dtype)
    out = Gaussian(mean, cov=cov) if full else Gaussian(mean, var=cov.diagonal(dim1=-2, dim2=-1))
    y = torch.randn(b, generator=gen, dtype=F64).to(dtype)
    lik = HeteroscedasticGaussian()
    closed = lik.expected_log_prob(out, y)
    mc = Likelihood.expected_log_prob(lik, out, y, mc_samples=200_000)
    assert closed.dtype == dtype and closed.shape == (b,)
    assert torch.allclose(closed.double(), mc.double(), atol=2e-2)


def test_homoscedastic_closed_form_predictive_and_gradient() -> None:
    gen = torch.Generator().manual_seed(4)
    lik = HomoscedasticGaussian(init_log_variance=-1.0)
    mean = torch.randn(6, 1, generator=gen)
    var = torch.rand(6, 1, generator=gen) * 0.3
    out = Gaussian(mean, var=var)
    y = torch.randn(6, 1, generator=gen)  # [B, 1] targets are accepted for regression
    closed = lik.expected_log_prob(out, y)
    mc = Likelihood.expected_log_prob(lik, out, y, mc_samples=200_000)
    assert torch.allclose(closed, mc, atol=1e-2)
    noise = math.exp(-1.0)
    expect = -0.5 * (
        math.log(2 * math.pi * noise) + ((y[:, 0] - mean[:, 0]) ** 2 + var[:, 0]) / noise
    )
    assert torch.allclose(closed, expect, atol=1e-6)
    closed.sum().backward()
    assert lik.log_variance.grad is not None and torch.isfinite(lik.log_variance.grad)
    pred = lik.predictive(out)
    assert torch.allclose(pred.variance, var[:, 0] + noise)
    assert torch.allclose(pred.mean, mean[:, 0])


def test_regression_log_prob_on_samples() -> None:
    f = torch.randn(5, 3, 2)
    y = torch.randn(3)
    ref = torch.distributions.Normal(f[..., 0], torch.exp(f[..., 1] / 2)).log_prob(y)
    assert torch.allclose(HeteroscedasticGaussian().log_prob(f, y), ref, atol=1e-5)
    lik = HomoscedasticGaussian(0.5)
    ref = torch.distributions.Normal(f[..., :1], math.exp(0.25)).log_prob(y[:, None])[..., 0]
    assert torch.allclose(lik.log_prob(f[..., :1], y), ref, atol=1e-5)


# ---------------------------------------------------------------- classification
def _logit_gaussian(gen, b: int, k: int, scale: float):
    mean = torch.randn(b, k, generator=gen, dtype=F64) * 1.5
    cov = torch.stack([_random_cov(gen, k, scale) for _ in range(b)])
    return mean, cov


@pytest.mark.parametrize("full", [True, False])
def test_categorical_delta_matches_monte_carlo_for_small_covariance(full: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    b, k = 6, 4
    mean, cov = _logit_gaussian(gen, b, k, 0.1)
    if not full:
        cov = torch.diag_embed(cov.diagonal(dim1=-2, dim2=-1))
    y = torch.randint(k, (b,), generator=gen)
    eps = torch.randn(200_000, b, k, generator=gen, dtype=F64)
    samples = mean + (torch.linalg.cholesky(cov) @ eps.unsqueeze(-1)).squeeze(-1)
    log_sm = torch.log_softmax(samples, -1)
    mc_ll = log_sm.gather(-1, y.expand(200_000, b).unsqueeze(-1)).squeeze(-1).mean(0)
    mc_probs = log_sm.exp().mean(0)

    out = Gaussian(mean, cov=cov) if full else Gaussian(mean, var=cov.diagonal(dim1=-2, dim2=-1))
    lik = Categorical(k, method="delta")
    ll = lik.expected_log_prob(out, y)
    probs = lik.predictive(out).probs
    assert (ll - mc_ll).abs().max() < 2e-2
    assert (probs - mc_probs).abs().max() < 2e-2
    # The correction matters: the plug-in softmax is further from the oracle.
    plug_in = torch.log_softmax(mean, -1).gather(-1, y[:, None])[:, 0]
    assert (ll - mc_ll).abs().mean() < (plug_in - mc_ll).abs().mean()

    mc_lik = Categorical(k, method="mc", mc_samples=20_000)
    assert (mc_lik.expected_log_prob(out, y) - mc_ll).abs().max() < 2e-2
    assert (mc_lik.predictive(out).probs - mc_probs).abs().max() < 2e-2
    # The generic base-class estimate agrees with the delta-method override.
    base = Likelihood.expected_log_prob(lik, out, y, mc_samples=100_000)
    assert (base - ll).abs().max() < 2e-2


def test_delta_method_equals_second_order_taylor_by_autograd() -> None:
    # Independent check of the paper's Hessians: E g(a) ~ g(mu) + 1/2 tr(C H_g(mu)).
    gen = torch.Generator().manual_seed(6)
    k = 5
    mean = torch.randn(k, generator=gen, dtype=F64)
    cov = _random_cov(gen, k, 0.5)
    for y in range(k):
        hess = torch.autograd.functional.hessian(lambda a, y=y: torch.log_softmax(a, -1)[y], mean)
        taylor = torch.log_softmax(mean, -1)[y] + 0.5 * (cov * hess).sum()
        got = functional.categorical_delta_expected_log_prob(mean, cov, torch.tensor(y))
        assert torch.allclose(got, taylor, atol=1e-12)
    hess_p = torch.stack(
        [
            torch.autograd.functional.hessian(lambda a, j=j: torch.softmax(a, -1)[j], mean)
            for j in range(k)
        ]
    )
    taylor_p = torch.softmax(mean, -1) + 0.5 * (cov * hess_p).sum((-1, -2))
    assert taylor_p.min() > 0  # so clamping is inactive and the two must agree exactly
    assert torch.allclose(functional.categorical_delta_predictive(mean, cov), taylor_p, atol=1e-12)


@pytest.mark.parametrize("factor", [400.0, 1e4, 1e8])
@pytest.mark.parametrize("full", [True, False])
def test_categorical_predictive_is_a_distribution_for_huge_covariance(factor, full) -> None:
    gen = torch.Generator().manual_seed(7)
    mean, cov = _logit_gaussian(gen, 32, 10, 0.1 * factor)
    for dtype in (torch.float32, F64):
        c = cov if full else cov.diagonal(dim1=-2, dim2=-1)
        out = (
            Gaussian(mean.to(dtype), cov=c.to(dtype))
            if full
            else Gaussian(mean.to(dtype), var=c.to(dtype))
        )
        probs = Categorical(10).predictive(out).probs
        assert torch.isfinite(probs).all()
        assert (probs >= 0).all()
        assert torch.allclose(probs.sum(-1), torch.ones(32, dtype=dtype), atol=1e-5)


def test_categorical_log_prob_on_samples_and_float_labels() -> None:
    f = torch.randn(3, 4, 5)
    y = torch.tensor([0, 4, 2, 1])
    ref = torch.distributions.Categorical(logits=f).log_prob(y)
    lik = Categorical(5)
    assert torch.allclose(lik.log_prob(f, y), ref, atol=1e-6)
    assert torch.allclose(lik.log_prob(f, y.double()), ref, atol=1e-6)  # integral floats ok


# ---------------------------------------------------------------- bad inputs
def _reg_out(b: int = 3, d: int = 2) -> Gaussian:
    return Gaussian(torch.zeros(b, d), var=torch.ones(b, d))


@pytest.mark.parametrize(
    ("lik", "out", "y", "match"),
    [
        (HeteroscedasticGaussian(), _reg_out(), torch.zeros(4), "target shape"),
        (HeteroscedasticGaussian(), _reg_out(), torch.zeros(3, 2), "target shape"),
        (HeteroscedasticGaussian(), _reg_out(), torch.tensor([0.0, math.nan, 1.0]), "NaN"),
        (HeteroscedasticGaussian(), _reg_out(), torch.tensor([0.0, math.inf, 1.0]), "NaN or Inf"),
        (HeteroscedasticGaussian(), _reg_out(d=3), torch.zeros(3), "consumes 2"),
        (HeteroscedasticGaussian(require_full=True), _reg_out(), torch.zeros(3), "diag output"),
        (HomoscedasticGaussian(), _reg_out(), torch.zeros(3), "consumes 1"),
        (Categorical(2), _reg_out(), torch.tensor([0, 1, 2]), "out of range"),
        (Categorical(2), _reg_out(), torch.tensor([0, -1, 1]), "out of range"),
        (Categorical(2), _reg_out(), torch.tensor([0.0, 0.5, 1.0]), "non-integer"),
        (Categorical(2), _reg_out(), torch.tensor([0.0, math.nan, 1.0]), "NaN"),
        (Categorical(2), _reg_out(), torch.tensor([True, False, True]), "integers"),
        (Categorical(2), _reg_out(), torch.zeros(3, 1, dtype=torch.long), "target shape"),
    ],
)
def test_bad_inputs_raise_value_error_naming_the_problem(lik, out, y, match) -> None:
    with pytest.raises(ValueError, match=match):
        lik.expected_log_prob(out, y)


def test_bad_inputs_other_entry_points() -> None:
    with pytest.raises(ValueError, match="Gaussian"):
        HeteroscedasticGaussian().expected_log_prob(torch.zeros(3, 2), torch.zeros(3))
    with pytest.raises(ValueError, match="target shape"):
        HeteroscedasticGaussian().log_prob(torch.zeros(5, 3, 2), torch.zeros(4))
    with pytest.raises(ValueError, match="out of range"):
        Categorical(3).log_prob(torch.zeros(5, 2, 3), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="consumes 3"):
        Categorical(3).predictive(_reg_out())
    with pytest.raises(ValueError, match="method"):
        Categorical(3, method="probit")
    with pytest.raises(ValueError, match="num_classes"):
        Categorical(1)
    with pytest.raises(ValueError, match="mc_samples"):
        HeteroscedasticGaussian(mc_samples=0)
    with pytest.raises(ValueError, match="init_log_variance"):
        HomoscedasticGaussian(init_log_variance=math.nan)
    with pytest.raises(ValueError, match="neither a diag"):
        functional.categorical_delta_predictive(torch.zeros(2, 3), torch.zeros(2, 3, 2))


def test_gradients_are_finite_through_closed_forms() -> None:
    mean = torch.randn(4, 2, dtype=F64, requires_grad=True)
    cov = torch.eye(2, dtype=F64).expand(4, 2, 2) * 0.1
    HeteroscedasticGaussian().expected_log_prob(
        Gaussian(mean, cov=cov), torch.zeros(4, dtype=F64)
    ).sum().backward()
    assert torch.isfinite(mean.grad).all()
    logits = torch.randn(4, 3, dtype=F64, requires_grad=True)
    Categorical(3).expected_log_prob(
        Gaussian(logits, var=torch.full((4, 3), 0.1, dtype=F64)), torch.tensor([0, 1, 2, 0])
    ).sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert np.isfinite(logits.grad.numpy()).all()
