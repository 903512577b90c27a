"""The per-datum ELBO: its parts, DVI vs MCVI on one model, schedules and input checks."""

import math

import pytest
import torch

from lightning_dvi.likelihoods import Categorical, HeteroscedasticGaussian, HomoscedasticGaussian
from lightning_dvi.nn import mlp
from lightning_dvi.objective import ELBOTerms, KLSchedule, elbo
from lightning_dvi.priors import EmpiricalBayes, GaussianPrior

F64 = torch.float64


def _data(b: int = 16, d: int = 2, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(b, d, generator=gen, dtype=dtype), torch.randn(b, generator=gen, dtype=dtype)


@pytest.mark.parametrize("mode", ["full", "diag"])
def test_terms_are_consistent_with_their_parts(mode: str) -> None:
    net = mlp(2, [8], 2)
    lik, prior = HeteroscedasticGaussian(), EmpiricalBayes()
    x, y = _data()
    terms = elbo(net, lik, prior, x, y, num_data=100, mode=mode, kl_weight=0.3)
    assert isinstance(terms, ELBOTerms)
    ell = lik.expected_log_prob(net(x, mode=mode), y).mean()
    kl = prior.kl(net)
    assert torch.allclose(terms.expected_log_likelihood, ell)
    assert torch.allclose(terms.kl, kl)
    assert torch.allclose(terms.loss, -(ell - 0.3 * kl / 100))
    assert torch.allclose(terms.elbo, ell - kl / 100)
    assert not terms.elbo.requires_grad and terms.kl_weight == 0.3
    assert terms.loss.shape == ()
    terms.loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in net.parameters())


def test_sampling_mode_uses_the_same_model_and_prior_as_dvi() -> None:
    # A Bayesian linear model has an exactly Gaussian output, so full DVI is exact and MCVI with
    # many weight samples must agree with it up to Monte Carlo error.
    torch.manual_seed(2)
    net = mlp(2, [], 2, init_scale=0.3).double()
    lik, prior = HeteroscedasticGaussian(), GaussianPrior(1.0)
    x, y = _data(8, 2, F64)
    dvi = elbo(net, lik, prior, x, y, num_data=50, mode="full")
    with torch.no_grad():
        for mode in ("sample", "local"):
            mc = elbo(net, lik, prior, x, y, num_data=50, mode=mode, num_samples=100_000)
            assert torch.allclose(mc.kl, dvi.kl)
            assert abs(mc.expected_log_likelihood - dvi.expected_log_likelihood) < 2e-2


def test_classification_and_homoscedastic_objectives_run_in_every_mode() -> None:
    x = torch.randn(10, 3)
    labels = torch.randint(4, (10,))
    net = mlp(3, [6], 4)
    for mode, s in (("full", None), ("diag", None), ("sample", 3), ("local", 2)):
        terms = elbo(net, Categorical(4), GaussianPrior(), x, labels, 200, mode=mode, num_samples=s)
        assert torch.isfinite(terms.loss)
    lik = HomoscedasticGaussian()
    terms = elbo(mlp(3, [6], 1), lik, EmpiricalBayes(), x, torch.randn(10, 1), 200)
    terms.loss.backward()
    assert lik.log_variance.grad is not None


def test_kl_schedule() -> None:
    assert [KLSchedule()(s) for s in range(3)] == [1.0, 1.0, 1.0]
    assert [KLSchedule(warmup_steps=2)(s) for s in range(4)] == [0.0, 0.0, 1.0, 1.0]
    sched = KLSchedule(warmup_steps=3, anneal_steps=4)
    assert [sched(s) for s in range(9)] == [0, 0, 0, 0.25, 0.5, 0.75, 1, 1, 1]
    assert KLSchedule(anneal_steps=2)(0) == 0.5
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="warmup_steps"):
            KLSchedule(warmup_steps=bad)
        with pytest.raises(ValueError, match="anneal_steps"):
            KLSchedule(anneal_steps=bad)
    with pytest.raises(ValueError, match="step"):
        sched(-1)


def test_non_finite_loss_raises_unless_disabled() -> None:
    net = mlp(2, [4], 2)
    with torch.no_grad():
        net[-1].bias_loc[1] = -1e4  # e^{-l} overflows: an infinite expected log-likelihood
    x, y = _data()
    with pytest.raises(FloatingPointError, match="not finite"):
        elbo(net, HeteroscedasticGaussian(), GaussianPrior(), x, y, 100)
    terms = elbo(net, HeteroscedasticGaussian(), GaussianPrior(), x, y, 100, check_finite=False)
    assert not torch.isfinite(terms.loss)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_data": 0}, "num_data"),
        ({"num_data": 10.0}, "num_data"),
        ({"num_data": True}, "num_data"),
        ({"mode": "mean_field"}, "unknown mode"),
        ({"num_samples": 4}, "num_samples"),
        ({"mode": "sample", "num_samples": 0}, "num_samples"),
        ({"kl_weight": -0.1}, "kl_weight"),
        ({"kl_weight": math.nan}, "kl_weight"),
        ({"y": torch.zeros(15)}, "do not match"),
        ({"y": torch.zeros(16, 2)}, "target shape"),
        ({"y": torch.full((16,), math.nan)}, "NaN"),
        ({"mode": "sample", "num_samples": 2, "y": torch.full((16,), math.inf)}, "NaN or Inf"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs, match) -> None:
    x, y = _data()
    args = {"num_data": 100, "y": y, **kwargs}
    with pytest.raises(ValueError, match=match):
        elbo(mlp(2, [4], 2), HeteroscedasticGaussian(), GaussianPrior(), x, **args)


def test_likelihood_width_mismatch_is_reported() -> None:
    x, y = _data()
    with pytest.raises(ValueError, match="consumes 2"):
        elbo(mlp(2, [4], 3), HeteroscedasticGaussian(), GaussianPrior(), x, y, 100)
    with pytest.raises(ValueError, match="consumes 2"):
        elbo(mlp(2, [4], 3), HeteroscedasticGaussian(), GaussianPrior(), x, y, 100, mode="local")


def test_empty_batch_is_named():
    from lightning_dvi.likelihoods import HeteroscedasticGaussian
    from lightning_dvi.nn import mlp
    from lightning_dvi.priors import EmpiricalBayes

    with pytest.raises(ValueError, match="empty batch"):
        elbo(
            mlp(3, [4], 2),
            HeteroscedasticGaussian(),
            EmpiricalBayes(),
            torch.zeros(0, 3),
            torch.zeros(0),
            10,
        )
