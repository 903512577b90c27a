"""Classification closed forms for large logit variances (issue 17), against Monte Carlo."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import cpu_trainer, log_softmax_draws, logit_grid
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, Gaussian
from lightning_dvi.likelihoods import Categorical
from lightning_dvi.likelihoods import functional as F
from lightning_dvi.likelihoods.predictive import categorical_predictive

F64 = torch.float64
SCALES = (1e-2, 1e-1, 1.0, 10.0, 100.0)
GAPS = (0.0, 1.0, 5.0, 20.0)
DRAWS = 25_000
# Documented bounds (docs/likelihoods_and_priors.md; measured with 2e5 draws over a larger grid
# by recipes/categorical_closed_forms.py: TV max 0.254, 0.0136 for v <= 0.1, 0.0174 for K = 2;
# expected log-likelihood max 0.61 nats, 0.016 for v <= 0.1), plus Monte Carlo slack.
TV_BOUND, TV_BOUND_SMALL_V, TV_BOUND_BINARY = 0.27, 0.02, 0.025
LL_BOUND, LL_BOUND_SMALL_V = 0.65, 0.025


@pytest.fixture(scope="module")
def oracle():
    """Monte Carlo predictive and per-label expected log-likelihood for every grid point."""
    gen = torch.Generator().manual_seed(1)
    rows = []
    for k, v, mean, cov, full in logit_grid(0, SCALES, GAPS):
        log_sm = log_softmax_draws(mean, full, DRAWS, gen)
        rows.append((k, v, mean, cov, log_sm.exp().mean(0), log_sm.mean(0)))
    return rows


def test_mean_field_predictive_total_variation_bound(oracle) -> None:
    worst = worst_small = worst_binary = worst_delta = 0.0
    for k, v, mean, cov, mc_probs, _ in oracle:
        tv = 0.5 * (F.categorical_mean_field_predictive(mean, cov) - mc_probs).abs().sum().item()
        worst = max(worst, tv)
        if v <= 0.1:
            worst_small = max(worst_small, tv)
        if k == 2:
            worst_binary = max(worst_binary, tv)
        delta = F.categorical_delta_predictive(mean, cov)
        worst_delta = max(worst_delta, 0.5 * (delta - mc_probs).abs().sum().item())
    assert worst < TV_BOUND
    assert worst_small < TV_BOUND_SMALL_V
    assert worst_binary < TV_BOUND_BINARY
    # The paper's delta predictive is the failure being fixed: far off somewhere on the grid.
    assert worst_delta > 0.5


def test_likelihood_predictive_uses_the_library_predictive(oracle) -> None:
    # the mean-field form above is one part of it (tests/test_softmax_predictive.py)
    for method in ("delta", "clark"):
        for k, _v, mean, cov, _, _ in oracle[::7]:
            out = (
                Gaussian(mean[None], cov=cov[None])
                if cov.dim() == 2
                else Gaussian(mean[None], var=cov[None])
            )
            probs = Categorical(k, method=method).predictive(out).probs[0]
            assert torch.allclose(probs, categorical_predictive(mean, cov), atol=1e-12)


def test_clark_expected_log_prob_error_bound(oracle) -> None:
    worst = worst_small = worst_delta = 0.0
    for k, v, mean, cov, _, mc_ll in oracle:
        labels = torch.arange(k)
        means, covs = mean.expand(k, k), cov.expand(k, *cov.shape)
        err = (F.categorical_clark_expected_log_prob(means, covs, labels) - mc_ll).abs().max()
        worst = max(worst, err.item())
        if v <= 0.1:
            worst_small = max(worst_small, err.item())
        delta = F.categorical_delta_expected_log_prob(means, covs, labels)
        worst_delta = max(worst_delta, (delta - mc_ll).abs().max().item())
    assert worst < LL_BOUND
    assert worst_small < LL_BOUND_SMALL_V
    # The delta method's v/2 correction breaks down at large variances (documented, measured).
    assert worst_delta > 10 * LL_BOUND


def test_clark_matches_the_plug_in_at_zero_covariance_and_is_below_it() -> None:
    gen = torch.Generator().manual_seed(2)
    mean = torch.randn(16, 5, generator=gen, dtype=F64) * 3
    y = torch.randint(5, (16,), generator=gen)
    plug_in = torch.log_softmax(mean, -1).gather(-1, y[:, None])[:, 0]
    assert torch.equal(
        F.categorical_clark_expected_log_prob(mean, torch.zeros_like(mean), y), plug_in
    )
    var = torch.rand(16, 5, generator=gen, dtype=F64) * 4
    assert (F.categorical_clark_expected_log_prob(mean, var, y) < plug_in).all()
    # Diag and the equivalent full covariance give the same value.
    assert torch.allclose(
        F.categorical_clark_expected_log_prob(mean, var, y),
        F.categorical_clark_expected_log_prob(mean, torch.diag_embed(var), y),
        atol=1e-12,
    )


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_isotropic_covariance_keeps_the_ranking_of_the_means(dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    for k in (2, 3, 10):
        mean = (torch.randn(64, k, generator=gen, dtype=F64) * 5).to(dtype)
        for v in (0.0, 1e-2, 1.0, 9.0, 38.0, 1e2, 1e4):
            probs = F.categorical_mean_field_predictive(mean, torch.full_like(mean, v))
            order = mean.argsort(-1)
            ranked = probs.gather(-1, order)
            assert (ranked[..., 1:] >= ranked[..., :-1]).all(), (k, v)
            top = probs.gather(-1, mean.argmax(-1, keepdim=True))
            assert (top >= probs).all()


def test_issue_17_example_no_zero_for_the_most_likely_class() -> None:
    # Mean logits 7.58 against <= 5.26, logit variances 9-38 (the issue's digits regime).
    mean = torch.tensor([[7.58, 5.26, 3.0, 1.0, -2.0, 0.5, 4.0, 2.2, -1.0, 0.0]])
    var = torch.tensor([[38.0, 9.0, 20.0, 15.0, 30.0, 12.0, 25.0, 18.0, 10.0, 33.0]])
    probs = F.categorical_mean_field_predictive(mean, var)
    assert probs.argmax().item() == 0
    assert F.categorical_delta_predictive(mean, var)[0, 0].item() == 0.0  # the old failure


def test_no_exact_zeros_in_float32_for_finite_inputs() -> None:
    gen = torch.Generator().manual_seed(4)
    mean = torch.randn(256, 10, generator=gen) * torch.logspace(-2, 3, 256)[:, None]
    for v in (0.0, 1e-3, 1.0, 1e2, 1e4):
        var = torch.full_like(mean, v)
        full = torch.diag_embed(var) + 0.5 * v
        for cov in (var, full):
            probs = F.categorical_mean_field_predictive(mean, cov)
            assert probs.dtype == torch.float32
            assert (probs > 0).all() and torch.isfinite(probs).all()
            assert torch.allclose(probs.sum(-1), torch.ones(256), atol=1e-5)
            ll = F.categorical_clark_expected_log_prob(
                mean, cov, torch.zeros(256, dtype=torch.long)
            )
            assert torch.isfinite(ll).all()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_gradients_are_finite_for_large_variances(dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    mean = (torch.randn(32, 10, generator=gen, dtype=F64) * 10).to(dtype).requires_grad_()
    a = torch.randn(32, 10, 10, generator=gen, dtype=F64).to(dtype)
    for scale in (0.0, 1e-2, 1.0, 1e2, 1e3):
        cov = (scale * a @ a.transpose(-1, -2) / 10).requires_grad_()
        var = cov.diagonal(dim1=-2, dim2=-1).detach().clone().requires_grad_()
        y = torch.randint(10, (32,), generator=gen)
        for c in (cov, var):
            loss = F.categorical_clark_expected_log_prob(mean, c, y).sum()
            loss = loss + F.categorical_mean_field_predictive(mean, c).log()[..., 0].sum()
            g_mean, g_cov = torch.autograd.grad(loss, (mean, c))
            assert torch.isfinite(g_mean).all() and torch.isfinite(g_cov).all()


def test_bad_covariance_shape_raises() -> None:
    with pytest.raises(ValueError, match="neither a diag"):
        F.categorical_mean_field_predictive(torch.zeros(2, 3), torch.zeros(2, 3, 2))
    with pytest.raises(ValueError, match="neither a diag"):
        F.categorical_clark_expected_log_prob(
            torch.zeros(2, 3), torch.zeros(3, 3, 3), torch.zeros(2)
        )
    with pytest.raises(ValueError, match="method"):
        Categorical(3, method="laplace")


@pytest.mark.parametrize("method", ["delta", "clark"])
def test_classifier_nll_and_predict_finite_with_large_logit_variances(method, tmp_path) -> None:
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(96, 6, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
    model = DVIClassifier(
        in_features=6, num_classes=3, hidden=[16], num_data=96, likelihood_method=method, lr=1e-2
    )
    with torch.no_grad():  # a wide posterior: logit variances in the tens, as in the issue
        for name, p in model.named_parameters():
            if "raw_scale" in name:
                p.fill_(1.0)
            elif "loc" in name:
                p.mul_(6.0)
    out = model.net(x, mode="full")
    assert out.var.median() > 10
    data = DataLoader(TensorDataset(x, y), batch_size=32)
    trainer = cpu_trainer(
        max_epochs=1, limit_train_batches=2, enable_checkpointing=False, default_root_dir=tmp_path
    )
    trainer.fit(model, data)
    for p in model.parameters():
        assert torch.isfinite(p).all()
    metrics = trainer.test(model, data, verbose=False)[0]
    assert math.isfinite(metrics["test/nll"])
    probs = torch.cat(trainer.predict(model, DataLoader(TensorDataset(x), batch_size=32)))
    assert (probs > 0).all() and torch.isfinite(probs).all()
    assert math.isfinite(-probs.gather(-1, y[:, None]).log().mean().item())


@pytest.mark.parametrize("tolerance", [0.01, 0.03, 0.1])
def test_probit_tolerance_skips_within_its_total_variation_bound(tolerance) -> None:
    """Skipping the multinomial-probit part moves every example by at most 1 - omega <= eps
    in total variation (float64 oracle: the unskipped formula), and only where allowed."""
    gen = torch.Generator().manual_seed(3)
    limit = (math.pi**2 / 6) * tolerance / (1 - tolerance)  # the largest mean variance skipped
    for k in (2, 3, 9):
        mean = 4 * torch.randn(64, k, generator=gen, dtype=F64)
        var = limit * torch.rand(64, k, generator=gen, dtype=F64)
        var[0] = limit  # one example exactly at the limit
        skipped = categorical_predictive(mean, var, probit_tolerance=tolerance)
        full = categorical_predictive(mean, var)
        one_minus_omega = var.mean(-1) / (math.pi**2 / 6 + var.mean(-1))
        tv = 0.5 * (skipped - full).abs().sum(-1)
        assert bool((tv <= one_minus_omega + 1e-12).all())
        assert float(one_minus_omega.max()) <= tolerance + 1e-12
        assert float(tv.max()) > 0  # it did skip: the two parts differ
        torch.testing.assert_close(skipped, _cmf(mean, var), rtol=0, atol=0)
        # one example above the limit: no skip anywhere (the unskipped formula exactly)
        var[1] = 2 * limit + 0.1
        torch.testing.assert_close(
            categorical_predictive(mean, var, probit_tolerance=tolerance),
            categorical_predictive(mean, var),
            rtol=0,
            atol=0,
        )


def _cmf(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    from lightning_dvi.likelihoods.predictive import categorical_conditional_mean_field

    return categorical_conditional_mean_field(mean, var)


def test_probit_tolerance_against_monte_carlo() -> None:
    """Where it skips (logit variances up to 0.05, a posterior's scale), the result stays
    within 5e-3 of 4e5-draw Monte Carlo and within the 0.03 bound of the unskipped mixture's
    own error."""
    gen = torch.Generator().manual_seed(4)
    for k in (3, 9):
        for gap in (0.0, 2.0, 6.0):
            mean = gap * torch.rand(k, generator=gen, dtype=F64)
            var = 0.05 * torch.rand(k, generator=gen, dtype=F64)
            mc = log_softmax_draws(mean, torch.diag(var), 400_000, gen).exp().mean(0)
            skipped = categorical_predictive(mean, var, probit_tolerance=0.03)
            full = categorical_predictive(mean, var)
            tv_skip = 0.5 * float((skipped - mc).abs().sum())
            tv_full = 0.5 * float((full - mc).abs().sum())
            # measured: 2e-4 ... 2.1e-3 skipped, 2e-4 ... 7e-4 unskipped (MC noise about 1e-4)
            assert tv_skip < 5e-3
            assert tv_skip <= tv_full + 0.03


def test_probit_tolerance_checked() -> None:
    with pytest.raises(ValueError, match="probit_tolerance"):
        categorical_predictive(torch.zeros(3), torch.ones(3), probit_tolerance=1.0)
