"""The exact heteroscedastic predictive density against independent oracles.

``heteroscedastic_predictive_log_prob`` integrates :math:`\\mathcal N(y; m, e^\\ell)` over the
bivariate Gaussian :math:`q(m, \\ell)` by adaptive Gauss-Hermite quadrature. Oracles: scipy's
adaptive ``quad`` over :math:`\\ell` (written here in numpy/scipy), a two-dimensional Monte
Carlo over :math:`(m, \\ell)` (no conditioning), and the normalisation :math:`\\int p = 1`.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from lightning_dvi.likelihoods import HeteroscedasticPredictive
from lightning_dvi.likelihoods import functional as F

F64 = torch.float64


def _quad_log_prob(mm: float, vm: float, ml: float, vl: float, cml: float, y: float) -> float:
    """log p(y) by scipy's adaptive quadrature over l of N(l) N(y | l), m integrated out.

    The integrand is scaled by its largest value on a fine grid, so densities far below the
    smallest float still have a finite log.
    """
    beta = cml / vl
    rest = vm - beta * cml
    sd = math.sqrt(vl)

    def log_integrand(ell: np.ndarray) -> np.ndarray:
        cond_sd = np.sqrt(rest + np.exp(ell))
        return stats.norm.logpdf(ell, ml, sd) + stats.norm.logpdf(
            y, mm + beta * (ell - ml), cond_sd
        )

    def scalar(ell: float) -> float:  # the same integrand, scaled, in plain floats (fast)
        var = rest + math.exp(ell)
        log_f = -0.5 * ((ell - ml) ** 2 / vl + (y - mm - beta * (ell - ml)) ** 2 / var)
        return math.exp(log_f - 0.5 * math.log(4 * math.pi**2 * vl * var) - shift)

    preferred = math.log(max((y - mm) ** 2, 1e-300))
    lo, hi = ml - 200 * sd - 1, max(ml + 40 * sd, preferred + 10)
    shift = float(log_integrand(np.linspace(lo, hi, 200_001)).max())
    points = [p for p in sorted({ml, preferred}) if lo < p < hi]
    value, _ = integrate.quad(
        scalar,
        lo,
        hi,
        points=points,
        limit=500,
        epsrel=1e-12,
        epsabs=0,
    )
    return math.log(value) + shift


def _grid() -> list[tuple[float, ...]]:
    cases = []
    for vl, vm, rho, residual in itertools.product(
        [1e-4, 0.01, 0.1, 1.0, 4.0],
        [0.0, 0.01, 1.0, 10.0],
        [0.0, 0.5, -0.9],
        [0.0, 0.5, 3, 30, 300],
    ):
        ml = -3.0
        cml = rho * math.sqrt(vl * vm)
        y = residual * math.exp(ml / 2)  # residual in predicted noise deviations
        cases.append((0.0, vm, ml, vl, cml, y))
    return cases


def test_the_quadrature_matches_scipy_on_a_grid_of_spreads_correlations_and_residuals() -> None:
    cases = _grid()
    oracle = torch.tensor([_quad_log_prob(*c) for c in cases], dtype=F64)
    mm, vm, ml, vl, cml, y = torch.tensor(cases, dtype=F64).unbind(-1)
    got = F.heteroscedastic_predictive_log_prob(mm, vm, ml, vl, cml, y)
    err = (got - oracle).abs()
    # the bimodal cases (a strongly correlated mean, a far target) included
    assert float(err[vl <= 1].max()) < 5e-4
    assert float(err.max()) < 3e-3
    sd = (vm + (ml + vl / 2).exp()).sqrt()
    gaussian = torch.distributions.Normal(mm, sd).log_prob(y)
    noisy = vm < 0.1 * (ml + vl / 2).exp()  # the noise dominates the variance
    far = ((y - mm).abs() > 8 * sd) & (vl >= 0.01) & noisy  # 8 predictive deviations out
    assert int(far.sum()) >= 10
    assert bool((got[far] > gaussian[far] + 1.0).all())  # heavier than the moments' Gaussian


def test_a_two_dimensional_monte_carlo_agrees_without_conditioning() -> None:
    gen = torch.Generator().manual_seed(7)
    n = 400_000
    for mean, cov, y in [
        ((0.3, -1.0), ((0.2, 0.1), (0.1, 0.5)), 1.5),
        ((0.0, -2.0), ((0.05, -0.08), (-0.08, 0.3)), -0.2),
        ((1.0, 0.5), ((1.0, 0.0), (0.0, 2.0)), 9.0),
    ]:
        mu, sigma = torch.tensor(mean, dtype=F64), torch.tensor(cov, dtype=F64)
        draws = mu + torch.randn(n, 2, generator=gen, dtype=F64) @ torch.linalg.cholesky(sigma).T
        density = torch.distributions.Normal(draws[:, 0], (draws[:, 1] / 2).exp()).log_prob(
            torch.tensor(y, dtype=F64)
        )
        values = density.exp()
        mc, stderr = float(values.mean()), float(values.std()) / math.sqrt(n)
        got = F.heteroscedastic_predictive_log_prob(
            mu[0], sigma[0, 0], mu[1], sigma[1, 1], sigma[0, 1], torch.tensor(y, dtype=F64)
        )
        assert abs(math.exp(float(got)) - mc) < 5 * stderr


def test_the_density_integrates_to_one_and_keeps_the_moments() -> None:
    ys = torch.linspace(-60, 60, 120_001, dtype=F64)
    pred = HeteroscedasticPredictive(
        torch.tensor(0.5, dtype=F64),
        torch.tensor(0.3, dtype=F64),
        torch.tensor(0.0, dtype=F64),
        torch.tensor(1.5, dtype=F64),
        torch.tensor(0.2, dtype=F64),
    )
    p = pred.log_prob(ys).exp()
    step = float(ys[1] - ys[0])
    assert float(p.sum()) * step == pytest.approx(1.0, abs=2e-4)
    assert float((ys * p).sum()) * step == pytest.approx(float(pred.mean), abs=2e-3)
    second = float(((ys - pred.mean) ** 2 * p).sum()) * step
    assert second == pytest.approx(float(pred.variance), rel=3e-2)  # the tails beyond +-60


def test_a_point_log_variance_is_the_gaussian_exactly() -> None:
    y = torch.linspace(-3, 3, 7, dtype=F64)
    z = torch.zeros(7, dtype=F64)
    got = F.heteroscedastic_predictive_log_prob(z + 0.1, z + 0.2, z - 1.0, z, None, y)
    scale = torch.tensor(math.sqrt(0.2 + math.exp(-1.0)), dtype=F64)
    want = torch.distributions.Normal(torch.tensor(0.1, dtype=F64), scale).log_prob(y)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)


def test_float32_is_finite_and_close_to_float64_far_into_the_tails() -> None:
    gen = torch.Generator().manual_seed(2)
    parts = [
        torch.randn(500, generator=gen, dtype=F64),
        torch.rand(500, generator=gen, dtype=F64) * 0.1,
        torch.randn(500, generator=gen, dtype=F64) * 2 - 4,
        torch.rand(500, generator=gen, dtype=F64) * 0.5,
    ]
    cov = 0.5 * (parts[1] * parts[3]).sqrt() * (torch.rand(500, generator=gen, dtype=F64) - 0.5)
    y = torch.randn(500, generator=gen, dtype=F64) * torch.logspace(-1, 3, 500, dtype=F64)
    wide = F.heteroscedastic_predictive_log_prob(*parts, cov, y)
    narrow = F.heteroscedastic_predictive_log_prob(*(p.float() for p in parts), cov.float(), y)
    assert narrow.dtype == torch.float32 and bool(torch.isfinite(narrow).all())
    torch.testing.assert_close(narrow.double(), wide, rtol=1e-4, atol=1e-4)


def test_gradients_are_the_quadratures() -> None:
    gen = torch.Generator().manual_seed(4)
    inputs = (
        torch.randn(3, generator=gen, dtype=F64),
        (torch.rand(3, generator=gen, dtype=F64) * 0.3 + 0.05),
        torch.randn(3, generator=gen, dtype=F64) - 1,
        (torch.rand(3, generator=gen, dtype=F64) * 0.4 + 0.05),
        torch.full((3,), 0.02, dtype=F64),
        torch.tensor([0.1, 2.5, -4.0], dtype=F64),
    )
    inputs = tuple(t.requires_grad_() for t in inputs)
    assert torch.autograd.gradcheck(F.heteroscedastic_predictive_log_prob, inputs)


def test_large_batches_are_chunked_with_the_same_values(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(5)
    parts = [torch.randn(2, 50, generator=gen, dtype=F64) for _ in range(6)]
    parts[1], parts[3] = parts[1].abs(), parts[3].abs()
    parts[4] = 0.3 * (parts[1] * parts[3]).sqrt()
    whole = F.heteroscedastic_predictive_log_prob(*parts)
    monkeypatch.setattr(F, "PREDICTIVE_CHUNK", 16)
    chunked = F.heteroscedastic_predictive_log_prob(*parts)
    assert chunked.shape == (2, 50)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-12)


def test_the_sampler_and_cdf_follow_the_density() -> None:
    torch.manual_seed(0)
    pred = HeteroscedasticPredictive(
        torch.tensor([0.0], dtype=F64),
        torch.tensor([0.1], dtype=F64),
        torch.tensor([-1.0], dtype=F64),
        torch.tensor([0.8], dtype=F64),
        torch.tensor([0.15], dtype=F64),
    )
    draws = pred.sample((200_000,))[:, 0].numpy()
    points = np.array([-3.0, -1.0, 0.0, 0.4, 2.5])
    empirical = (draws[:, None] <= points).mean(0)
    cdf = pred.cdf(torch.tensor(points, dtype=F64)[:, None])[:, 0].numpy()
    assert np.abs(cdf - empirical).max() < 5 * 0.5 / math.sqrt(200_000)
    # the CDF's slope is the density
    h = 1e-4
    for y in points:
        slope = (
            pred.cdf(torch.tensor([[y + h]], dtype=F64))
            - pred.cdf(torch.tensor([[y - h]], dtype=F64))
        ) / (2 * h)
        density = pred.log_prob(torch.tensor([y], dtype=F64)).exp()
        assert float(slope) == pytest.approx(float(density), rel=1e-5)
