"""Dequantised targets: the likelihoods' resolution, the grid detection and DVIRegressor's option."""

from __future__ import annotations

import io
import math

import numpy as np
import pytest
import torch
from helpers import cpu_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIRegressor, Gaussian
from lightning_dvi.lightning.regressor import target_grid_step
from lightning_dvi.likelihoods import HeteroscedasticGaussian, HomoscedasticGaussian
from lightning_dvi.likelihoods.gaussian import dequantisation_variance


def _heteroscedastic_out() -> Gaussian:
    mean = torch.tensor([[0.3, -1.0], [-0.2, 0.4]], dtype=torch.float64)
    cov = torch.tensor(
        [[[0.04, 0.01], [0.01, 0.09]], [[0.1, -0.02], [-0.02, 0.05]]], dtype=torch.float64
    )
    return Gaussian(mean, cov=cov)


def test_dequantised_expected_log_prob_matches_monte_carlo_over_weights_and_grid_noise():
    """E over (m, l) ~ N and u ~ U(-d/2, d/2) of log N(y + u; m, e^l), 400 000 draws."""
    out, y, step = _heteroscedastic_out(), torch.tensor([0.0, 1.0], dtype=torch.float64), 0.8
    closed = HeteroscedasticGaussian(resolution=step).expected_log_prob(out, y)
    g = torch.Generator().manual_seed(0)
    n = 400_000
    chol = torch.linalg.cholesky(out.cov)
    z = torch.randn(n, 2, 2, generator=g, dtype=torch.float64)
    draws = out.mean + torch.einsum("bij,nbj->nbi", chol, z)
    u = (torch.rand(n, 2, generator=g, dtype=torch.float64) - 0.5) * step
    m, log_var = draws[..., 0], draws[..., 1]
    values = torch.distributions.Normal(m, (0.5 * log_var).exp()).log_prob(y + u)
    mc, se = values.mean(0), values.std(0) / math.sqrt(n)
    assert torch.all((closed - mc).abs() < 4 * se + 1e-4), (closed, mc, se)
    # and it is a real change: the grid noise lowers the expected log-likelihood here
    plain = HeteroscedasticGaussian().expected_log_prob(out, y)
    assert torch.all(plain - closed > 20 * se)


def test_homoscedastic_dequantised_matches_quadrature_over_the_grid_cell():
    """Deterministic outputs: the closed form against 64-point Gauss-Legendre over u.

    (The log variance was a float32 parameter before ``.double()``: agreement to ~1e-8.)
    """
    lik = HomoscedasticGaussian(init_log_variance=math.log(0.3), resolution=1.0).double()
    out = Gaussian(
        torch.tensor([[0.2], [1.7]], dtype=torch.float64), var=torch.zeros(2, 1).double()
    )
    y = torch.tensor([0.0, 2.0], dtype=torch.float64)
    nodes, weights = np.polynomial.legendre.leggauss(64)
    u = torch.tensor(nodes * 0.5, dtype=torch.float64)[:, None]
    w = torch.tensor(weights * 0.5, dtype=torch.float64)[:, None]
    dist = torch.distributions.Normal(out.mean[:, 0], math.sqrt(0.3))
    quadrature = (w * dist.log_prob(y + u)).sum(0)
    torch.testing.assert_close(lik.expected_log_prob(out, y), quadrature, rtol=1e-7, atol=1e-7)


def test_resolution_zero_is_the_plain_likelihood_bit_for_bit():
    out, y = _heteroscedastic_out(), torch.tensor([0.5, -0.5], dtype=torch.float64)
    assert torch.equal(
        HeteroscedasticGaussian(resolution=0.0).expected_log_prob(out, y),
        HeteroscedasticGaussian().expected_log_prob(out, y),
    )
    assert dequantisation_variance(0.0) == 0.0 and dequantisation_variance(0.5) == 0.25 / 12


@pytest.mark.parametrize("bad", [-0.1, math.nan, math.inf])
def test_a_bad_resolution_is_refused(bad):
    with pytest.raises(ValueError, match="resolution must be finite and >= 0"):
        HeteroscedasticGaussian(resolution=bad)


@pytest.mark.parametrize(
    ("values", "step"),
    [
        ([3.0, 5.0, 6.0, 5.0], 1.0),  # integer scores (UCI wine)
        ([21.6, 34.7, 50.0], 0.1),  # one decimal (UCI boston)
        ([15.55, 20.84, 6.01], 0.01),  # two decimals (UCI energy)
        ([10.0, 20.0, 40.0], 10.0),
        ([0.1234567, 0.5], 0.0),  # continuous
        ([7.0, 7.0], 0.0),  # constant
        ([0.001, 0.003], 0.001),  # the step never exceeds the range
    ],
)
def test_target_grid_step(values, step):
    assert target_grid_step(torch.tensor(values, dtype=torch.float64)) == pytest.approx(step)


def test_target_grid_step_survives_float32_and_standardising():
    y = torch.tensor([3.0, 4.0, 5.0, 6.0, 8.0])
    loc, scale = float(y.mean()), float(y.std())
    back = ((y - loc) / scale) * scale + loc  # float32 rounding on the way
    assert target_grid_step(back) == 1.0


def _integer_data(n: int = 240) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer targets that are mostly equal on each side: y = round(3 tanh(2x))."""
    x = torch.linspace(-2, 2, n)[:, None]
    y = torch.round(3 * torch.tanh(2 * x[:, 0]))
    return x, y


def _fit(resolution, x, y, steps: int = 25) -> DVIRegressor:
    torch.manual_seed(0)
    model = DVIRegressor(
        hidden=[32], optimizer="lbfgs", lbfgs_iterations=10, target_resolution=resolution
    )
    loader = DataLoader(TensorDataset(x, y), batch_size=len(x))
    cpu_trainer(max_epochs=steps, enable_checkpointing=False).fit(model, loader)
    return model


def test_auto_resolution_keeps_the_noise_from_collapsing_on_equal_targets():
    """The real failure: full-batch L-BFGS drives the noise to ~0 where all targets are equal.

    The dequantised objective keeps the predictive standard deviation near the grid's
    :math:`1/\\sqrt{12} \\approx 0.29` there, so a target one step away is not thousands of
    nats improbable.
    """
    x, y = _integer_data()
    plain = _fit(None, x, y)
    dequantised = _fit("auto", x, y)
    assert dequantised.hparams["target_resolution"] == 1.0
    assert dequantised.target_resolution == 1.0
    scale = float(dequantised.target_scale)
    assert dequantised.likelihood.resolution == pytest.approx(1.0 / scale)
    flat = x[:, 0] > 1.2  # every target here is 3
    assert bool((y[flat] == 3).all())
    _, var_plain = plain.predictive(x[flat])
    _, var_deq = dequantised.predictive(x[flat])
    # measured (25 steps): 0.14 against 0.39; 60 steps: 0.06 against 0.33, and falling
    assert float(var_plain.sqrt().min()) < 0.2
    assert float(var_deq.sqrt().min()) > 0.3
    # a target one grid step away from the plateau
    away = torch.full((int(flat.sum()),), 2.0)
    ll_plain = plain.predictive_log_prob(x[flat], away).mean()
    ll_deq = dequantised.predictive_log_prob(x[flat], away).mean()
    # measured: -20.4 against -3.1 (60 steps: -110 against -4.1)
    assert float(ll_deq) > -6 and float(ll_plain) < float(ll_deq) - 10


def test_the_resolved_step_is_kept_in_the_checkpoint(tmp_path):
    x, y = _integer_data(60)
    model = _fit("auto", x, y, steps=2)
    path = tmp_path / "m.ckpt"
    trainer = cpu_trainer(max_epochs=1, enable_checkpointing=False)
    trainer.strategy.connect(model)
    trainer.save_checkpoint(path)
    loaded = DVIRegressor.load_from_checkpoint(path)
    assert loaded.target_resolution == 1.0
    assert loaded.likelihood.resolution == pytest.approx(model.likelihood.resolution)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)  # no new state: the step lives in the hparams
    assert set(model.state_dict()) == set(DVIRegressor(hidden=[32], in_features=1).state_dict())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"target_resolution": -1.0}, "target_resolution must be None, 'auto'"),
        ({"target_resolution": "fine"}, "target_resolution must be None, 'auto'"),
        ({"target_resolution": True}, "target_resolution must be None, 'auto'"),
        (
            {"target_resolution": 1.0, "likelihood": "poisson", "standardize_targets": False},
            "for the Gaussian likelihoods",
        ),
    ],
)
def test_bad_target_resolution_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DVIRegressor(in_features=1, hidden=[4], **kwargs)


def test_a_given_step_is_divided_by_the_target_scale():
    model = DVIRegressor(in_features=1, hidden=[4], target_scale=2.0, target_resolution=0.5)
    assert model.likelihood.resolution == pytest.approx(0.25)
    homo = DVIRegressor(
        in_features=1, hidden=[4], likelihood="homoscedastic", target_resolution=0.5
    )
    assert homo.likelihood.resolution == pytest.approx(0.5)


def test_coarse_in_memory_targets_warn_and_name_the_option():
    x, y = _integer_data(60)  # integer scores, standard deviation about 2.5
    with pytest.warns(UserWarning, match="target_resolution='auto'"):
        _fit(None, x, y, steps=1)


@pytest.mark.parametrize("resolution", ["auto", 0.0])
def test_no_warning_once_the_resolution_is_chosen_or_for_fine_targets(resolution, recwarn):
    x, y = _integer_data(60)
    _fit(resolution, x, y, steps=1)
    _fit(None, x, y * 0.013 + torch.linspace(0, 1e-3, 60), steps=1)  # continuous
    assert not [w for w in recwarn if "lie on a grid" in str(w.message)]
