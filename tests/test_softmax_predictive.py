"""The categorical predictive (issue 26): within 0.15 TV of a 100k-draw Monte Carlo at 1e-3..1e3."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import logit_grid

from lightning_dvi import Gaussian
from lightning_dvi.likelihoods import Categorical
from lightning_dvi.likelihoods import functional as F
from lightning_dvi.likelihoods import predictive as P

F64 = torch.float64
VARIANCES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1000.0)
GAPS = (0.0, 1.0, 5.0, 20.0)
DRAWS = 100_000
# The target is 0.15 everywhere. Measured on this grid (float64 and float32): at most
# 0.023 (K = 3, correlated full covariance, v = 1000), 0.005 for v <= 0.1, 0.004 for K = 2;
# the Monte Carlo oracle's own error is about 0.005. The bounds leave room for that noise and
# catch a regression long before 0.15.
TV_TARGET, TV_BOUND, TV_BOUND_SMALL_V, TV_BOUND_BINARY = 0.15, 0.04, 0.01, 0.01
# Classes whose Monte Carlo probabilities differ by more than this are never ranked the other
# way round (measured: the largest difference flipped is 0.013, between near-tied classes
# under a correlated full covariance; the pairwise mean-field form flips 0.24).
RANK_MARGIN = 0.02


@pytest.fixture(scope="module")
def oracle():
    """``(K, v, mean, cov, Monte Carlo predictive)`` for every grid point (float64)."""
    gen = torch.Generator().manual_seed(1)
    base = {k: torch.randn(DRAWS, k, generator=gen, dtype=F64) for k in (2, 3, 10)}
    rows = []
    for k, v, mean, cov, full in logit_grid(0, VARIANCES, GAPS):
        chol = torch.linalg.cholesky(full + 1e-12 * torch.eye(k, dtype=F64))
        draws = torch.addmm(mean, base[k], chol.T)  # one set of draws per K, shared
        rows.append((k, v, mean, cov, torch.softmax(draws, -1).mean(0)))
    return rows


def _tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return 0.5 * (p.double() - q).abs().sum().item()


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_predictive_total_variation_against_monte_carlo(oracle, dtype) -> None:
    worst = worst_small = worst_binary = worst_mean_field = 0.0
    for k, v, mean, cov, mc in oracle:
        tv = _tv(P.categorical_predictive(mean.to(dtype), cov.to(dtype)), mc)
        worst = max(worst, tv)
        if v <= 0.1:
            worst_small = max(worst_small, tv)
        if k == 2:
            worst_binary = max(worst_binary, tv)
        worst_mean_field = max(
            worst_mean_field, _tv(F.categorical_mean_field_predictive(mean, cov), mc)
        )
    assert worst <= TV_BOUND <= TV_TARGET
    assert worst_small <= TV_BOUND_SMALL_V
    assert worst_binary <= TV_BOUND_BINARY
    # the pairwise mean-field form alone is what missed the target at large variances
    assert worst_mean_field > TV_TARGET


def test_no_ranking_flips_against_monte_carlo(oracle) -> None:
    for k, v, mean, cov, mc in oracle:
        probs = P.categorical_predictive(mean, cov)
        gap_mc = mc.unsqueeze(-1) - mc.unsqueeze(-2)
        gap = probs.unsqueeze(-1) - probs.unsqueeze(-2)
        flipped = (gap_mc > RANK_MARGIN) & (gap < 0)
        assert not flipped.any(), (k, v, mean, probs, mc)


def test_confident_classifier_regime_is_not_under_confident() -> None:
    # One class ahead, logit variances of order one: where a trained classifier's predictions
    # live. The pairwise mean-field form under-states the top class by 1-5 points here, which
    # shows up as under-confidence (docs/calibration.md); the conditional form does not.
    gen = torch.Generator().manual_seed(9)
    eps = torch.randn(200_000, 10, generator=gen, dtype=F64)
    spread = torch.linspace(0.5, 1.5, 10, dtype=F64)
    for top in (5.0, 7.0, 9.0):
        for v in (0.3, 1.0, 3.0):
            mean = torch.cat([torch.tensor([top], dtype=F64), torch.linspace(-2, 1, 9, dtype=F64)])
            var = v * spread
            mc = torch.softmax(mean + eps * var.sqrt(), -1).mean(0)[0]
            error = abs(P.categorical_predictive(mean, var)[0] - mc)
            assert error < 0.01, (top, v)
            if v >= 1:  # the pairwise form is low by more, and by more than the oracle's noise
                low = mc - F.categorical_mean_field_predictive(mean, var)[0]
                assert low > max(2 * error, 0.005), (top, v)


def test_multinomial_probit_is_the_large_variance_limit(oracle) -> None:
    # Exact up to quadrature for diag covariances as the Gumbel noise stops mattering; the
    # Mendell-Elston path for correlated full ones is close.
    for _k, v, mean, cov, mc in oracle:
        if v >= 100:
            assert _tv(P.categorical_multinomial_probit(mean, cov), mc) < 0.03


def test_both_paths_of_the_multinomial_probit_agree_on_a_diagonal_covariance() -> None:
    gen = torch.Generator().manual_seed(7)
    mean = torch.randn(16, 6, generator=gen, dtype=F64) * 3
    var = (
        torch.rand(16, 6, generator=gen, dtype=F64) * torch.logspace(-2, 3, 16, dtype=F64)[:, None]
    )
    quadrature = P.categorical_multinomial_probit(mean, var)  # diag: conditional quadrature
    elston = P.categorical_multinomial_probit(mean, torch.diag_embed(var))  # full: Mendell-Elston
    assert (quadrature - elston).abs().sum(-1).max() < 0.04


def test_many_classes_take_the_quadrature_path_and_stay_close_to_monte_carlo() -> None:
    k = P.MENDELL_ELSTON_MAX_CLASSES + 8
    gen = torch.Generator().manual_seed(8)
    for v in (0.1, 10.0, 1000.0):
        mean = torch.randn(k, generator=gen, dtype=F64) * 2
        a = torch.randn(k, k, generator=gen, dtype=F64) / math.sqrt(k)
        full = v * (a @ a.T + torch.eye(k, dtype=F64)) / 2
        draws = (
            mean + torch.randn(40_000, k, generator=gen, dtype=F64) @ torch.linalg.cholesky(full).T
        )
        mc = torch.softmax(draws, -1).mean(0)
        assert _tv(P.categorical_predictive(mean, full), mc) < 0.1


@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("full", [False, True])
def test_isotropic_covariance_keeps_the_ranking_of_the_means(dtype, full) -> None:
    gen = torch.Generator().manual_seed(3)
    for k in (2, 3, 10, 40):
        mean = (torch.randn(64 if k < 40 else 8, k, generator=gen, dtype=F64) * 5).to(dtype)
        for v in (0.0, 1e-3, 1.0, 9.0, 1e2, 1e3, 1e4):
            var = torch.full_like(mean, v)
            probs = P.categorical_predictive(mean, torch.diag_embed(var) if full else var)
            ranked = probs.gather(-1, mean.argsort(-1))
            assert (ranked[..., 1:] >= ranked[..., :-1]).all(), (k, v)


def test_exact_at_zero_covariance_and_no_exact_zeros_in_float32() -> None:
    gen = torch.Generator().manual_seed(4)
    mean = torch.randn(256, 10, generator=gen) * torch.logspace(-2, 3, 256)[:, None]
    zero = P.categorical_predictive(mean.double(), torch.zeros(256, 10, dtype=F64))
    assert torch.allclose(zero, torch.softmax(mean.double(), -1).clamp_min(1e-300), atol=1e-12)
    for v in (0.0, 1e-3, 1.0, 1e2, 1e4):
        var = torch.full_like(mean, v)
        for cov in (var, torch.diag_embed(var) + 0.5 * v):
            probs = P.categorical_predictive(mean, cov)
            assert probs.dtype == torch.float32
            assert (probs > 0).all() and torch.isfinite(probs).all()
            assert torch.allclose(probs.sum(-1), torch.ones(256), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_gradients_are_finite_for_any_variance(dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    mean = (torch.randn(32, 10, generator=gen, dtype=F64) * 10).to(dtype).requires_grad_()
    a = torch.randn(32, 10, 10, generator=gen, dtype=F64).to(dtype)
    for scale in (0.0, 1e-3, 1.0, 1e2, 1e3):
        cov = (scale * a @ a.transpose(-1, -2) / 10).requires_grad_()
        var = cov.diagonal(dim1=-2, dim2=-1).detach().clone().requires_grad_()
        for c in (cov, var):
            loss = P.categorical_predictive(mean, c).log()[..., 0].sum()
            g_mean, g_cov = torch.autograd.grad(loss, (mean, c))
            assert torch.isfinite(g_mean).all() and torch.isfinite(g_cov).all()


def test_gradients_flow_after_a_first_call_under_inference_mode(monkeypatch) -> None:
    # Lightning validates under inference mode; the cached quadrature nodes built there must
    # still be usable by the next training step's backward pass.
    from lightning_dvi.moments import _quadrature

    monkeypatch.setattr(_quadrature, "_CONSTANTS", {})  # the node tensors, built afresh below
    mean = torch.randn(4, 3, dtype=F64)
    var = torch.rand(4, 3, dtype=F64)
    with torch.inference_mode():
        P.categorical_predictive(mean, var)
    mean.requires_grad_(), var.requires_grad_()
    grads = torch.autograd.grad(P.categorical_predictive(mean, var).log().sum(), (mean, var))
    assert all(torch.isfinite(g).all() for g in grads)


def test_the_likelihood_and_its_export_use_this_predictive() -> None:
    gen = torch.Generator().manual_seed(6)
    mean = torch.randn(4, 5, generator=gen, dtype=F64)
    var = torch.rand(4, 5, generator=gen, dtype=F64) * 50
    for method in ("delta", "clark"):
        lik = Categorical(5, method=method)
        for out, cov in (
            (Gaussian(mean, var=var), var),
            (Gaussian(mean, cov=torch.diag_embed(var)), None),
        ):
            expected = P.categorical_predictive(
                mean, var if cov is not None else torch.diag_embed(var)
            )
            assert torch.allclose(lik.predictive(out).probs, expected, atol=1e-12)


def test_gauss_hermite_rule_integrates_gaussian_moments() -> None:
    z, log_w = P.gauss_hermite(P.QUADRATURE_NODES)
    w = log_w.exp()
    for power, moment in ((0, 1.0), (2, 1.0), (4, 3.0), (6, 15.0), (8, 105.0)):
        assert abs(float((w * z**power).sum()) - moment) < 1e-9 * moment


def test_bad_covariance_shape_raises() -> None:
    with pytest.raises(ValueError, match="neither a diag"):
        P.categorical_predictive(torch.zeros(2, 3), torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="neither a diag"):
        P.categorical_multinomial_probit(torch.zeros(2, 3), torch.zeros(3, 3, 3))
