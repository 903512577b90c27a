"""Linear-layer and skip-connection moments against Monte Carlo (within 3 standard errors)."""

import math

import pytest
import torch

from lightning_dvi.moments import (
    cross_through_activation,
    cross_through_linear,
    linear_deterministic,
    linear_diag,
    linear_full,
    linear_full_from_diag,
    relu_full,
    relu_slope,
    residual_full,
)
from lightning_dvi.moments.linear import NARROW_OUTPUTS

N = 400_000
DT = torch.float64


def _params(gen, d_in, d_out):
    w_loc = torch.randn(d_out, d_in, generator=gen, dtype=DT) / math.sqrt(d_in)
    w_var = torch.rand(d_out, d_in, generator=gen, dtype=DT) * 0.2
    b_loc = torch.randn(d_out, generator=gen, dtype=DT) * 0.1
    b_var = torch.rand(d_out, generator=gen, dtype=DT) * 0.05
    return w_loc, w_var, b_loc, b_var


def _sample_layer(gen, h, w_loc, w_var, b_loc, b_var):
    """a = h W^T + b with a fresh weight draw per sample."""
    w = w_loc + w_var.sqrt() * torch.randn(h.shape[0], *w_loc.shape, generator=gen, dtype=DT)
    b = b_loc + b_var.sqrt() * torch.randn(h.shape[0], b_loc.shape[0], generator=gen, dtype=DT)
    return torch.einsum("ni,noi->no", h, w) + b


def _assert_moments_within_3se(samples, mean, cov):
    n = samples.shape[0]
    centred = samples - samples.mean(0)
    se_mean = samples.std(0) / math.sqrt(n)
    assert ((samples.mean(0) - mean).abs() <= 3 * se_mean + 1e-12).all()
    prods = centred.unsqueeze(-1) * centred.unsqueeze(-2)
    se_cov = prods.std(0) / math.sqrt(n)
    assert ((prods.mean(0) - cov).abs() <= 3 * se_cov + 1e-12).all(), (prods.mean(0) - cov) / se_cov


def _gaussian_input(gen, d):
    a = torch.randn(d, d, generator=gen, dtype=DT)
    cov = a @ a.T / d + 0.1 * torch.eye(d, dtype=DT)
    return torch.randn(d, generator=gen, dtype=DT), cov


def test_linear_deterministic_input_matches_mc():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, generator=gen, dtype=DT)
    params = _params(gen, 3, 4)
    mean, var = linear_deterministic(x, *params)
    samples = _sample_layer(gen, x.expand(N, 3), *params)
    _assert_moments_within_3se(samples, mean, torch.diag(var))


def test_linear_full_gaussian_input_matches_mc():
    gen = torch.Generator().manual_seed(1)
    m, c = _gaussian_input(gen, 4)
    params = _params(gen, 4, 3)
    mean, cov = linear_full(m, c, *params)
    h = torch.distributions.MultivariateNormal(m, c).sample((N,))
    _assert_moments_within_3se(_sample_layer(gen, h, *params), mean, cov)


def test_linear_diag_matches_mc_with_independent_input():
    gen = torch.Generator().manual_seed(2)
    m = torch.randn(4, generator=gen, dtype=DT)
    v = torch.rand(4, generator=gen, dtype=DT) + 0.2
    params = _params(gen, 4, 3)
    mean, var = linear_diag(m, v, *params)
    h = m + v.sqrt() * torch.randn(N, 4, generator=gen, dtype=DT)
    samples = _sample_layer(gen, h, *params)
    full_mean, full_cov = linear_full(m, torch.diag(v), *params)
    torch.testing.assert_close(mean, full_mean)
    torch.testing.assert_close(var, full_cov.diagonal())
    _assert_moments_within_3se(samples, mean, full_cov)


def test_skip_connection_cross_covariance_matches_mc():
    # a = a' + relu(a') W^T + b: the cross term Cov(a', delta) is exact by Stein's lemma.
    gen = torch.Generator().manual_seed(3)
    m, c = _gaussian_input(gen, 4)
    params = _params(gen, 4, 4)
    cross = cross_through_linear(
        cross_through_activation(c, relu_slope(m, c.diagonal())), params[0]
    )
    a_prime = torch.distributions.MultivariateNormal(m, c).sample((N,))
    delta = _sample_layer(gen, torch.relu(a_prime), *params)
    joint = torch.cat([a_prime, delta], dim=1)
    centred = joint - joint.mean(0)
    prods = centred[:, :4].unsqueeze(-1) * centred[:, 4:].unsqueeze(-2)
    se = prods.std(0) / math.sqrt(N)
    assert ((prods.mean(0) - cross).abs() <= 3 * se).all()


def test_skip_connection_total_moments_match_mc():
    # The residual output's covariance combines the exact cross term with the DVI ReLU
    # approximation, so compare it at the ReLU approximation's tolerance.
    gen = torch.Generator().manual_seed(4)
    m, c = _gaussian_input(gen, 4)
    params = _params(gen, 4, 4)
    h_mean, h_cov = relu_full(m, c)
    d_mean, d_cov = linear_full(h_mean, h_cov, *params)
    cross = cross_through_linear(
        cross_through_activation(c, relu_slope(m, c.diagonal())), params[0]
    )
    mean, cov = residual_full(m, c, d_mean, d_cov, cross)
    a_prime = torch.distributions.MultivariateNormal(m, c).sample((N,))
    out = a_prime + _sample_layer(gen, torch.relu(a_prime), *params)
    sd = out.std(0)
    assert ((out.mean(0) - mean).abs() <= 3 * sd / math.sqrt(N)).all()
    mc_cov = torch.cov(out.T)
    assert ((mc_cov - cov).abs() / torch.outer(sd, sd)).max() < 2e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("d_out", [1, 3, NARROW_OUTPUTS, NARROW_OUTPUTS + 1, 40])
def test_full_from_diag_equals_full_with_diagonal_covariance(d_out, dtype):
    # both evaluations: the [D, K^2] weight products (narrow outputs) and per-example products
    gen = torch.Generator().manual_seed(5)
    m = torch.randn(2, 6, 4, generator=gen, dtype=DT)
    v = torch.rand(2, 6, 4, generator=gen, dtype=DT)
    params = _params(gen, 4, d_out)
    fast = linear_full_from_diag(*(t.to(dtype) for t in (m, v, *params)))
    slow = linear_full(m, torch.diag_embed(v), *params)
    torch.testing.assert_close(fast, tuple(t.to(dtype) for t in slow))
    torch.testing.assert_close(fast[1], fast[1].mT, rtol=0, atol=0)  # exactly symmetric


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(7,), (3, 5)])
def test_linear_diag_without_autograd_equals_the_formula(bias, lead):
    """No gradient to take: the variance as one matmul over [v, m^2] against [M^2 + V, V]
    (float64 oracle: the written-out formula), batch dimensions kept."""
    from lightning_dvi.moments.linear import _linear_diag_formula

    gen = torch.Generator().manual_seed(0)
    f64 = torch.float64
    mean = torch.randn(*lead, 6, generator=gen, dtype=f64)
    var = torch.rand(*lead, 6, generator=gen, dtype=f64)
    w, w_var = (
        torch.randn(4, 6, generator=gen, dtype=f64),
        torch.rand(4, 6, generator=gen, dtype=f64),
    )
    b = torch.randn(4, generator=gen, dtype=f64) if bias else None
    b_var = torch.rand(4, generator=gen, dtype=f64) if bias else None
    want_mean, want_var = _linear_diag_formula(mean, var, w, w_var, b, b_var)[:2]
    with torch.no_grad():
        got_mean, got_var = linear_diag(mean, var, w, w_var, b, b_var)
    assert got_var.shape == want_var.shape == (*lead, 4)
    torch.testing.assert_close(got_mean, want_mean, rtol=1e-14, atol=0)
    torch.testing.assert_close(got_var, want_var, rtol=1e-13, atol=0)
    # with a gradient to take: the fused Function, the same values
    w.requires_grad_(True)
    _, g_var = linear_diag(mean, var, w, w_var, b, b_var)
    torch.testing.assert_close(g_var.detach(), want_var, rtol=1e-13, atol=0)
