"""ReLU and Heaviside moments against independent oracles (quadrature, bivariate normal CDF)."""

import numpy as np
import pytest
import torch
from scipy import integrate, stats

from lightning_dvi.moments import (
    heaviside_diag,
    heaviside_full,
    heaviside_slope,
    relu_diag,
    relu_full,
    relu_slope,
)


def _random_cov(rng: np.random.Generator, d: int) -> np.ndarray:
    a = rng.normal(size=(d, d + 1))
    scales = np.exp(rng.normal(0, 0.7, d))
    cov = a @ a.T / (d + 1)
    return cov * np.outer(scales, scales)


def _relu_cross_moment(m1: float, m2: float, s1: float, s2: float, r: float) -> float:
    """E[relu(a1) relu(a2)] by 1-D quadrature over a1 with the exact conditional of a2."""
    cs = s2 * np.sqrt(1 - r * r)

    def integrand(a1: float) -> float:
        cm = m2 + r * s2 / s1 * (a1 - m1)
        z = cm / cs
        return a1 * (cm * stats.norm.cdf(z) + cs * stats.norm.pdf(z)) * stats.norm.pdf(a1, m1, s1)

    value, _ = integrate.quad(integrand, 0, np.inf, epsabs=1e-12, epsrel=1e-10, limit=200)
    return value


def _relu_mean_second(m: float, s: float) -> tuple[float, float]:
    e1 = integrate.quad(lambda a: a * stats.norm.pdf(a, m, s), 0, np.inf, epsabs=0, epsrel=1e-12)[0]
    e2 = integrate.quad(
        lambda a: a * a * stats.norm.pdf(a, m, s), 0, np.inf, epsabs=0, epsrel=1e-12
    )[0]
    return e1, e2


def _cases(seed: int, n: int, d: int) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.normal(0, 2, d), _random_cov(rng, d)) for _ in range(n)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu_off_diagonal_within_2e2_of_quadrature(dtype):
    worst = 0.0
    for mean, cov in _cases(seed=1, n=6, d=4):
        _, out = relu_full(torch.tensor(mean, dtype=dtype), torch.tensor(cov, dtype=dtype))
        sd = np.sqrt(np.diag(cov))
        for j in range(4):
            for k in range(j + 1, 4):
                r = cov[j, k] / (sd[j] * sd[k])
                e_jk = _relu_cross_moment(mean[j], mean[k], sd[j], sd[k], r)
                e_j = _relu_mean_second(mean[j], sd[j])[0]
                e_k = _relu_mean_second(mean[k], sd[k])[0]
                err = abs(out[j, k].item() - (e_jk - e_j * e_k)) / (sd[j] * sd[k])
                worst = max(worst, err)
    assert worst <= 2e-2, worst


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_relu_mean_and_diagonal_exact(dtype):
    rng = np.random.default_rng(2)
    mean = rng.normal(0, 2, 40)
    var = np.exp(rng.normal(0, 1, 40))
    out_mean, out_var = relu_diag(torch.tensor(mean, dtype=dtype), torch.tensor(var, dtype=dtype))
    _, full_cov = relu_full(
        torch.tensor(mean, dtype=dtype), torch.diag(torch.tensor(var, dtype=dtype))
    )
    rtol = 1e-5 if dtype == torch.float64 else 2e-4
    for i in range(40):
        e1, e2 = _relu_mean_second(mean[i], np.sqrt(var[i]))
        assert out_mean[i].item() == pytest.approx(e1, rel=rtol)
        assert out_var[i].item() == pytest.approx(e2 - e1 * e1, rel=rtol)
        assert full_cov[i, i].item() == pytest.approx(e2 - e1 * e1, rel=rtol)


def test_relu_diagonal_exact_in_far_tail():
    # Where the authors' approximate diagonal was 48 % low (mu = -3) and beyond.
    for mu in (-3.0, -6.0, -8.0):
        e1, e2 = _relu_mean_second(mu, 1.0)
        m, v = relu_diag(
            torch.tensor([mu], dtype=torch.float64), torch.ones(1, dtype=torch.float64)
        )
        assert m.item() == pytest.approx(e1, rel=1e-9)
        assert v.item() == pytest.approx(e2 - e1 * e1, rel=1e-7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_heaviside_against_bivariate_cdf(dtype):
    worst = 0.0
    for mean, cov in _cases(seed=3, n=6, d=4):
        out_mean, out = heaviside_full(
            torch.tensor(mean, dtype=dtype), torch.tensor(cov, dtype=dtype)
        )
        sd = np.sqrt(np.diag(cov))
        p = stats.norm.cdf(mean / sd)
        np.testing.assert_allclose(out_mean.double().numpy(), p, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(np.diag(out.double().numpy()), p * (1 - p), rtol=1e-4, atol=1e-7)
        for j in range(4):
            for k in range(j + 1, 4):
                sub = cov[np.ix_([j, k], [j, k])]
                both = stats.multivariate_normal(mean=-mean[[j, k]], cov=sub).cdf(np.zeros(2))
                worst = max(worst, abs(out[j, k].item() - (both - p[j] * p[k])))
    assert worst <= 5e-2, worst


def test_zero_correlation_gives_zero_off_diagonal_and_finite_grads():
    # The first layer's output covariance is exactly diagonal: the common case.
    mean = torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64, requires_grad=True)
    cov = torch.diag(torch.tensor([0.5, 1.5, 0.1], dtype=torch.float64)).requires_grad_()
    for fn in (relu_full, heaviside_full):
        m, c = fn(mean, cov)
        off = c - torch.diag_embed(c.diagonal())
        assert off.abs().max().item() == 0.0
        g_mean, g_cov = torch.autograd.grad((m.sum() + c.sum()), (mean, cov))
        assert torch.isfinite(g_mean).all() and torch.isfinite(g_cov).all()


def test_slopes_match_monte_carlo_cross_covariance():
    # Stein's lemma: Cov(a, f(a)) = Var(a) E[f'(a)]
    gen = torch.Generator().manual_seed(0)
    m, v = (
        torch.tensor([0.4, -0.7], dtype=torch.float64),
        torch.tensor([1.3, 0.6], dtype=torch.float64),
    )
    a = m + v.sqrt() * torch.randn(400_000, 2, generator=gen, dtype=torch.float64)
    for slope, f in ((relu_slope, torch.relu), (heaviside_slope, lambda t: (t > 0).double())):
        h = f(a)
        prod = (a - a.mean(0)) * (h - h.mean(0))
        se = prod.std(0) / np.sqrt(a.shape[0])
        expected = v * slope(m, v)
        assert ((prod.mean(0) - expected).abs() <= 3 * se).all()


def test_heaviside_diag_matches_full_diagonal():
    mean = torch.randn(5, 3, dtype=torch.float64)
    var = torch.rand(5, 3, dtype=torch.float64) + 0.1
    m_d, v_d = heaviside_diag(mean, var)
    m_f, c_f = heaviside_full(mean, torch.diag_embed(var))
    torch.testing.assert_close(m_d, m_f)
    torch.testing.assert_close(v_d, c_f.diagonal(dim1=-2, dim2=-1))
