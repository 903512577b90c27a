"""Bernoulli (one logit, two classes) and Poisson (a log-rate) likelihoods, against oracles, and
their use from DVIClassifier and DVIRegressor (issue 23)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from helpers import cpu_trainer
from scipy import integrate, stats
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIClassifier, DVIRegressor, Gaussian
from lightning_dvi.likelihoods import Bernoulli, Likelihood, Poisson, PoissonLogNormal
from lightning_dvi.metrics.ood import class_probability_samples

F64 = torch.float64


def _out(mean: list[float], var: list[float]) -> Gaussian:
    return Gaussian(
        torch.tensor(mean, dtype=F64)[:, None], var=torch.tensor(var, dtype=F64)[:, None]
    )


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_bernoulli_against_monte_carlo(dtype) -> None:
    out = _out([-3.0, -0.5, 0.0, 1.0, 4.0], [0.01, 2.0, 9.0, 0.5, 30.0])
    out = Gaussian(out.mean.to(dtype), var=out.var.to(dtype))
    y = torch.tensor([0, 1, 1, 0, 1])
    gen = torch.Generator().manual_seed(0)
    f = out.mean[:, 0] + out.var[:, 0].sqrt() * torch.randn(400_000, 5, generator=gen).to(dtype)
    lik = Bernoulli()
    mc_ll = torch.distributions.Bernoulli(logits=f).log_prob(y.to(dtype)).mean(0)
    ll = lik.expected_log_prob(out, y)
    assert (ll <= mc_ll + 0.01).all()  # a bound (Monte Carlo s.e. < 3e-3 here)
    torch.testing.assert_close(ll, mc_ll, rtol=0, atol=0.01)
    probs = lik.predictive(out).probs
    torch.testing.assert_close(probs, torch.sigmoid(f).mean(0), rtol=0, atol=3e-3)
    two = lik.predictive_probs(out)
    assert two.shape == (5, 2) and torch.allclose(two.sum(-1), torch.ones(5, dtype=dtype))
    # the base-class Monte Carlo estimate agrees with the closed form
    base = Likelihood.expected_log_prob(lik, out, y, mc_samples=200_000)
    torch.testing.assert_close(base, ll, rtol=0, atol=0.02)
    torch.testing.assert_close(
        lik.log_prob(f[:3, :, None], y),
        torch.distributions.Bernoulli(logits=f[:3]).log_prob(y.to(dtype)),
    )


def test_poisson_expected_log_prob_is_exact_and_predictive_moments_exact() -> None:
    out = _out([-2.0, 0.0, 1.5, 3.0], [0.0, 0.3, 1.0, 0.05])
    y = torch.tensor([0, 2, 7, 20])
    gen = torch.Generator().manual_seed(1)
    f = out.mean[:, 0] + out.var[:, 0].sqrt() * torch.randn(1_000_000, 4, generator=gen, dtype=F64)
    lik = Poisson()
    log_p = torch.distributions.Poisson(f.exp()).log_prob(y.to(F64))
    mc, se = log_p.mean(0), log_p.std(0) / 1000
    assert ((lik.expected_log_prob(out, y) - mc).abs() < 4 * se + 1e-12).all()
    pred = lik.predictive(out)
    assert isinstance(pred, PoissonLogNormal)
    counts = torch.poisson(f.exp(), generator=gen)
    torch.testing.assert_close(pred.mean, counts.mean(0), rtol=5e-3, atol=0)
    torch.testing.assert_close(pred.variance, counts.var(0), rtol=3e-2, atol=0)
    epistemic = lik.epistemic_variance(out)
    torch.testing.assert_close(epistemic, f.exp().var(0), rtol=3e-2, atol=1e-12)
    assert pred.sample((7,)).shape == (7, 4)


def test_poisson_log_normal_mass_against_quadrature() -> None:
    loc, var = torch.tensor([0.5, 2.0, -1.0], dtype=F64), torch.tensor([0.8, 0.2, 2.0], dtype=F64)
    pred = PoissonLogNormal(loc, var)
    for y in (0, 1, 4, 12):
        got = pred.log_prob(torch.full((3,), float(y), dtype=F64))
        for i in range(3):
            m, s = loc[i].item(), math.sqrt(var[i].item())
            mass = integrate.quad(
                lambda f, m=m, s=s, y=y: (
                    stats.poisson.pmf(y, math.exp(f)) * stats.norm.pdf(f, m, s)
                ),
                m - 12 * s,
                m + 12 * s,
                epsabs=1e-14,
                limit=200,
            )[0]
            assert got[i].item() == pytest.approx(math.log(mass), abs=1e-5)
    # total mass 1 and the exact mean, summed over the support
    ys = torch.arange(0, 400, dtype=F64)[:, None]
    mass = PoissonLogNormal(loc[:2], var[:2]).log_prob(ys).exp()
    torch.testing.assert_close(mass.sum(0), torch.ones(2, dtype=F64), rtol=0, atol=1e-6)
    torch.testing.assert_close((mass * ys).sum(0), pred.mean[:2], rtol=1e-5, atol=0)
    degenerate = PoissonLogNormal(torch.tensor([1.0], dtype=F64), torch.zeros(1, dtype=F64))
    exact = torch.distributions.Poisson(torch.tensor([math.e], dtype=F64)).log_prob(
        torch.tensor([3.0], dtype=F64)
    )
    torch.testing.assert_close(degenerate.log_prob(torch.tensor([3.0], dtype=F64)), exact)


@pytest.mark.parametrize(
    ("lik", "y", "match"),
    [
        (Bernoulli(), torch.tensor([0.0, 2.0]), "0 or 1"),
        (Bernoulli(), torch.tensor([0.0, math.nan]), "NaN"),
        (Poisson(), torch.tensor([1.0, -1.0]), "non-negative integers"),
        (Poisson(), torch.tensor([1.0, 0.5]), "standardize_targets=False"),
        (Poisson(), torch.tensor([True, False]), "dtype"),
        (Poisson(), torch.tensor([1.0, math.inf]), "NaN or Inf"),
    ],
)
def test_bad_targets_raise_naming_the_problem(lik, y, match) -> None:
    with pytest.raises(ValueError, match=match):
        lik.expected_log_prob(Gaussian(torch.zeros(2, 1), var=torch.ones(2, 1)), y)


def test_bool_labels_are_fine_for_bernoulli() -> None:
    out = Gaussian(torch.zeros(2, 1), var=torch.ones(2, 1))
    ll = Bernoulli().expected_log_prob(out, torch.tensor([True, False]))
    assert torch.isfinite(ll).all()


def _binary_data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(128, 3, generator=gen)
    return x, (x[:, 0] - x[:, 1] + 0.3 * torch.randn(128, generator=gen) > 0).long()


def test_classifier_with_one_logit(tmp_path) -> None:
    x, y = _binary_data()
    model = DVIClassifier(in_features=3, likelihood="bernoulli", hidden=[16], lr=1e-2)
    assert model.out_features == 1 and model.num_classes == 2
    assert model.net(x, mode="full").mean.shape == (128, 1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    cpu_trainer(max_epochs=15, default_root_dir=tmp_path).fit(model, loader, loader)
    probs = model.predictive(x)
    assert probs.shape == (128, 2) and torch.allclose(probs.sum(-1), torch.ones(128))
    assert (probs.argmax(-1) == y).float().mean() > 0.85
    draws = model.predictive(x, method="mc", num_samples=50)
    assert (draws - probs).abs().max() < 0.2
    # the OOD scores' class-probability samples treat one logit as two classes
    samples = class_probability_samples(model.net(x[:4], mode="full"), 8)
    assert samples.shape == (8, 4, 2)
    assert model.hparams["likelihood"] == "bernoulli"


def test_classifier_bernoulli_arguments() -> None:
    with pytest.raises(ValueError, match="num_classes must be 2"):
        DVIClassifier(in_features=3, num_classes=3, likelihood="bernoulli")
    with pytest.raises(ValueError, match="likelihood"):
        DVIClassifier(in_features=3, likelihood="probit")


def test_regressor_with_a_count_likelihood(tmp_path) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(160, 2, generator=gen)
    counts = torch.poisson((0.8 * x[:, 0] + 0.5).exp(), generator=gen)
    with pytest.raises(ValueError, match="standardize_targets=False"):
        DVIRegressor(in_features=2, likelihood="poisson")
    model = DVIRegressor(
        in_features=2, likelihood="poisson", standardize_targets=False, hidden=[16], lr=1e-2
    )
    loader = DataLoader(TensorDataset(x, counts), batch_size=40)
    trainer = cpu_trainer(max_epochs=20, default_root_dir=tmp_path)
    trainer.fit(model, loader, loader)
    mean, var = model.predictive(x)
    assert (var >= mean - 1e-6).all()  # over-dispersed: Var y = E y + Var e^f
    rmse = (mean - counts).square().mean().sqrt().item()
    assert rmse < counts.std().item()
    aleatoric, epistemic = model.variance_decomposition(x)
    # float64 outputs of float32 network moments: float32 rounding
    torch.testing.assert_close(aleatoric + epistemic, var, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(aleatoric, mean, rtol=1e-6, atol=1e-6)  # Poisson noise: E[e^f]
    log_p = model.predictive_log_prob(x, counts)
    assert np.isfinite(log_p.numpy()).all() and log_p.max() <= 0
    assert float(model.target_scale) == 1.0 and float(model.target_loc) == 0.0


def test_a_count_regressor_ignores_the_statistics_a_datamodule_or_the_cli_declares(tmp_path):
    """Counts are modelled in their own units: a datamodule's (or the CLI's linked) target
    statistics describe them but are never applied (they once mapped the counts to y s + m)."""
    from lightning.pytorch import LightningDataModule

    gen = torch.Generator().manual_seed(4)
    x = torch.randn(160, 2, generator=gen)
    counts = torch.poisson((0.3 * x[:, 0] + 1.5).exp(), generator=gen)

    class Counts(LightningDataModule):
        in_features, num_train = 2, 160
        target_loc, target_scale = float(counts.mean()), float(counts.std(correction=0))
        targets_standardized = False
        train_dataset = TensorDataset(x, counts)

        def train_dataloader(self):
            return DataLoader(self.train_dataset, batch_size=40)

    model = DVIRegressor(
        likelihood="poisson", standardize_targets=False, hidden=[8], lr=1e-2,
        target_loc=Counts.target_loc, target_scale=Counts.target_scale,  # as the CLI links them
    )  # fmt: skip
    cpu_trainer(max_epochs=5, default_root_dir=tmp_path).fit(model, Counts())
    assert float(model.target_loc) == 0.0 and float(model.target_scale) == 1.0
    mean, _ = model.predictive(x)
    with torch.no_grad():  # the likelihood's own predictive of the counts, not mapped by y s + m
        own = model.likelihood.predictive(model.net(x, mode=model.propagation.closed_form()))
    torch.testing.assert_close(mean, own.mean.to(mean.dtype), rtol=1e-6, atol=1e-6)
    assert np.isfinite(model.predictive_log_prob(x, counts).numpy()).all()

    Counts.targets_standardized = True
    with pytest.raises(ValueError, match="counts are modelled in their own units"):
        cpu_trainer(max_steps=1, default_root_dir=tmp_path).fit(
            DVIRegressor(likelihood="poisson", standardize_targets=False, hidden=[8]), Counts()
        )
