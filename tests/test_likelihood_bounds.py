"""The categorical training objective (issue 23): a bound that is never optimistic, and tight.

Oracles: ``scipy.integrate.quad`` for the one-dimensional logistic-normal integrals, Monte Carlo
(with its standard error) for the softmax expectation. Documented numbers:
docs/likelihoods_and_priors.md ("The training objective").
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from helpers import log_softmax_draws, logit_grid
from scipy import integrate

from lightning_dvi import DVIClassifier, Gaussian
from lightning_dvi.likelihoods import Categorical, logistic_normal
from lightning_dvi.likelihoods import functional as F

F64 = torch.float64
MEANS = (-20.0, -5.0, -2.0, -0.5, 0.0, 0.3, 1.0, 3.0, 10.0)
STDS = (1e-3, 0.03, 0.1, 0.3, 0.5, 1.0, 2.0, 5.0, 31.6)


def _quad(f, m: float, s: float) -> float:
    """``E f(x)``, ``x ~ N(m, s^2)``, split at the kink 0 and the mean (float64 reference)."""
    pts = sorted({m - 40 * s, m, min(max(0.0, m - 40 * s), m + 40 * s), m + 40 * s})
    c = 1 / (s * math.sqrt(2 * math.pi))
    g = lambda x: f(x) * c * math.exp(-0.5 * ((x - m) / s) ** 2)  # noqa: E731
    return sum(
        integrate.quad(g, a, b, epsabs=1e-14, epsrel=1e-13, limit=400)[0]
        for a, b in itertools.pairwise(pts)
    )


def _softplus(x: float) -> float:
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x)) if x >= 0 else math.exp(x) / (1 + math.exp(x))


@pytest.fixture(scope="module")
def reference():
    m, s = np.meshgrid(MEANS, STDS, indexing="ij")
    sp = np.vectorize(lambda a, b: _quad(_softplus, a, b))(m, s)
    sg = np.vectorize(lambda a, b: _quad(_sigmoid, a, b))(m, s)
    as_t = lambda a: torch.tensor(a, dtype=F64)  # noqa: E731
    return as_t(m), as_t(s) ** 2, as_t(sp), as_t(sg)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_softplus_bound_is_an_upper_bound_within_4e4(reference, dtype) -> None:
    m, v, exact, _ = reference
    got = F.softplus_normal_bound(m.to(dtype), v.to(dtype)).double()
    slack = (1e-12 if dtype == F64 else 2e-6) * (1 + exact)  # rounding (quadrature, float32)
    assert (got >= exact - slack).all()  # never below the integral: a bound
    assert ((got - exact) / exact).max() < 4e-4
    # The series branch alone (v > 0.1) is within the CRVZ guarantee 2/d_6 ~ 1e-4.
    wide = v > logistic_normal.SERIES_VARIANCE
    assert ((got - exact) / exact)[wide].max() < 1e-4 + (0 if dtype == F64 else 1e-5)


def test_asymptotic_branch_is_an_upper_bound_within_7e5() -> None:
    m = torch.tensor([-300.0, -60.0, -20.0, -5.0, -1.0, 0.0, 0.7, 3.0, 15.0, 80.0], dtype=F64)
    for s in (5.01, 8.0, 20.0, 100.0):  # v > ASYMPTOTIC_VARIANCE = 25
        exact = torch.tensor([_quad(_softplus, float(a), s) for a in m], dtype=F64)
        got = F.softplus_normal_bound(m, torch.full_like(m, s * s))
        assert (got >= exact - 1e-12 * (1 + exact)).all() and (got - exact).max() < 7e-5, s


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sigmoid_normal_mean_matches_quadrature(reference, dtype) -> None:
    m, v, _, exact = reference
    got = F.sigmoid_normal_mean(m.to(dtype), v.to(dtype)).double()
    assert (got - exact).abs().max() < 3e-5
    assert torch.equal(F.sigmoid_normal_mean(m, torch.zeros_like(m)), torch.sigmoid(m))


def test_bernoulli_bound_below_quadrature(reference) -> None:
    m, v, exact, _ = reference  # E log sigmoid(-x) = -E softplus(x)
    for y in (0, 1):
        sign = 1.0 if y == 0 else -1.0  # y = 1 at mean -m has the same integral
        got = F.bernoulli_expected_log_prob(sign * m, v, torch.full_like(m, y))
        assert (got <= -exact + 1e-12 * (1 + exact)).all()
        assert ((got + exact) / exact).abs().max() < 4e-4


def test_series_gradient_is_the_derivative_of_the_bound() -> None:
    gen = torch.Generator().manual_seed(0)
    m = (3 * torch.randn(12, generator=gen, dtype=F64)).requires_grad_()
    v = (0.2 + 5 * torch.rand(12, generator=gen, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(logistic_normal._softplus_series_bound, (m, v))
    # and the derivative in m is E sigmoid (to the series' accuracy)
    (g,) = torch.autograd.grad(logistic_normal._softplus_series_bound(m, v).sum(), m)
    assert (g - F.sigmoid_normal_mean(m.detach(), v.detach())).abs().max() < 1e-4


def test_policies_give_the_same_numbers(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(1)
    m = 4 * torch.randn(200, generator=gen, dtype=F64)
    v = torch.rand(200, generator=gen, dtype=F64) * torch.logspace(-3, 2, 200, dtype=F64)
    y = torch.randint(0, 10, (20,), generator=gen)
    mean, var = m.view(20, 10), v.view(20, 10)
    on_subset = (F.softplus_normal_bound(m, v), F.categorical_bound_expected_log_prob(mean, var, y))
    # the whole-tensor policy (other devices, torch.compile) computes every branch and selects
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    whole = (F.softplus_normal_bound(m, v), F.categorical_bound_expected_log_prob(mean, var, y))
    for a, b in zip(on_subset, whole, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)


@pytest.fixture(scope="module")
def monte_carlo():
    gen = torch.Generator().manual_seed(3)
    rows = []
    for k, v, mean, cov, full in logit_grid(2, (1e-3, 1e-1, 10.0, 1e3), (0.0, 2.0, 10.0)):
        log_sm = log_softmax_draws(mean, full, 20_000, gen)
        rows.append((k, v, mean, cov, log_sm.mean(0), log_sm.std(0) / 20_000**0.5))
    return rows


def test_categorical_bound_is_never_optimistic_and_tight_for_small_variances(monte_carlo) -> None:
    worst_z, worst_small, delta_opt, clark_opt = -math.inf, 0.0, 0.0, 0.0
    for k, v, mean, cov, mc, se in monte_carlo:
        labels = torch.arange(k)
        means, covs = mean.expand(k, k), cov.expand(k, *cov.shape)
        err = F.categorical_bound_expected_log_prob(means, covs, labels) - mc
        worst_z = max(worst_z, (err / se).max().item())
        if v <= 0.1:
            worst_small = max(worst_small, (-err).max().item())
        delta_opt = max(
            delta_opt,
            (F.categorical_delta_expected_log_prob(means, covs, labels) - mc).max().item(),
        )
        clark_opt = max(
            clark_opt,
            (F.categorical_clark_expected_log_prob(means, covs, labels) - mc).max().item(),
        )
    assert worst_z < 4.5  # never above Monte Carlo by more than its error (~300 comparisons)
    assert worst_small < 0.1  # documented: 0.09 nats for v <= 0.1
    # the two approximations it replaces are optimistic somewhere (the failure being fixed)
    assert delta_opt > 10 and clark_opt > 0.3


def test_categorical_bound_exact_at_zero_variance_and_for_two_classes() -> None:
    gen = torch.Generator().manual_seed(4)
    mean = 3 * torch.randn(64, 5, generator=gen, dtype=F64)
    y = torch.randint(5, (64,), generator=gen)
    exact = torch.log_softmax(mean, -1).gather(-1, y[:, None])[:, 0]
    got = F.categorical_bound_expected_log_prob(mean, torch.zeros_like(mean), y)
    torch.testing.assert_close(got, exact, rtol=0, atol=1e-12)
    # K = 2: the one-vs-each bound is the Bernoulli bound on the logit difference
    mean2, var2 = mean[:, :2], torch.rand(64, 2, generator=gen, dtype=F64) * 4
    y2 = y % 2
    diff_mean, diff_var = mean2[:, 1] - mean2[:, 0], var2.sum(-1)
    torch.testing.assert_close(
        F.categorical_bound_expected_log_prob(mean2, var2, y2),
        F.bernoulli_expected_log_prob(diff_mean, diff_var, y2),
        rtol=0,
        atol=1e-12,
    )
    # diag and the equivalent full covariance agree
    var = torch.rand(64, 5, generator=gen, dtype=F64) * 3
    torch.testing.assert_close(
        F.categorical_bound_expected_log_prob(mean, var, y),
        F.categorical_bound_expected_log_prob(mean, torch.diag_embed(var), y),
    )


def test_bound_tight_on_well_classified_points() -> None:
    # one dominant class, small variances: where training ends (relative error < 1 %)
    gen = torch.Generator().manual_seed(5)
    mean = torch.randn(8, 10, generator=gen, dtype=F64)
    mean[:, 0] += 5.0
    var = 0.05 * torch.rand(8, 10, generator=gen, dtype=F64)
    y = torch.zeros(8, dtype=torch.long)
    draws = mean + var.sqrt() * torch.randn(40_000, 8, 10, generator=gen, dtype=F64)
    mc = torch.log_softmax(draws, -1)[..., 0].mean(0)
    got = F.categorical_bound_expected_log_prob(mean, var, y)
    assert ((got - mc) / mc).abs().max() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_bound_values_and_gradients_finite_at_extremes(dtype) -> None:
    gen = torch.Generator().manual_seed(6)
    scale = torch.logspace(-2, 4, 40, dtype=F64)[:, None]
    mean = (torch.randn(40, 10, generator=gen, dtype=F64) * scale).to(dtype).requires_grad_()
    y = torch.randint(10, (40,), generator=gen)
    for v in (0.0, 1e-12, 1e-3, 1.0, 1e2, 1e3):
        var = torch.full((40, 10), v, dtype=dtype, requires_grad=True)
        ll = F.categorical_bound_expected_log_prob(mean, var, y)
        g_mean, g_var = torch.autograd.grad(ll.sum(), (mean, var))
        for t in (ll, g_mean, g_var):
            assert torch.isfinite(t).all(), v
        pairs = F.softplus_normal_bound(mean.detach(), var.detach())
        assert not ((pairs != 0) & (pairs < torch.finfo(dtype).tiny)).any(), "subnormal value"
    x = torch.tensor([-1e4, -50.0, 0.0, 50.0, 1e4], dtype=dtype, requires_grad=True)
    for v in (0.0, 1e-12, 0.5, 1e3):
        out = F.softplus_normal_bound(x, torch.full_like(x, v))
        (g,) = torch.autograd.grad(out.sum(), x)
        assert torch.isfinite(out).all() and torch.isfinite(g).all()


def test_categorical_and_classifier_default_to_the_tight_bound() -> None:
    assert Categorical(3).method == "tight"  # issue 41: the tighter certified bound
    model = DVIClassifier(in_features=2, num_classes=3, hidden=[4], num_data=10)
    assert model.likelihood.method == "tight"
    out = Gaussian(torch.zeros(2, 3), var=torch.full((2, 3), 0.5))
    y = torch.tensor([0, 2])
    torch.testing.assert_close(
        Categorical(3).expected_log_prob(out, y),
        F.categorical_tight_expected_log_prob(out.mean, out.var, y),
    )
