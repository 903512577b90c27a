"""Property tests (hypothesis): finiteness, symmetry and PSD-ness of the moment core at edges."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dvi import Gaussian
from lightning_dvi.moments import heaviside_full, relu_diag, relu_full
from lightning_dvi.nn import mlp

DTYPES = st.sampled_from([torch.float32, torch.float64])
FNS = st.sampled_from(["relu", "heaviside"])
SETTINGS = settings(max_examples=60, deadline=None)


def _fn(name):
    return relu_full if name == "relu" else heaviside_full


@st.composite
def gaussians(draw, min_diag_share=0.0):
    """Mean and covariance with huge means, tiny variances, and correlations at 0 and +-1."""
    d = draw(st.integers(1, 5))
    dtype = draw(DTYPES)
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    mean_scale = draw(st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e4]))
    var_scale = draw(st.sampled_from([1e-12, 1e-6, 1.0, 1e3]))
    structure = draw(st.sampled_from(["diagonal", "rank1", "random"]))
    mean = mean_scale * torch.randn(d, generator=gen, dtype=torch.float64)
    if structure == "diagonal":  # rho = 0 exactly (a first layer's output)
        cov = torch.diag(torch.rand(d, generator=gen, dtype=torch.float64) + 0.1)
    elif structure == "rank1":  # rho = +-1
        v = torch.randn(d, 1, generator=gen, dtype=torch.float64)
        cov = v @ v.T
    else:
        a = torch.randn(d, d, generator=gen, dtype=torch.float64)
        cov = a @ a.T / d
    if min_diag_share > 0:
        cov = cov + min_diag_share * cov.diagonal().mean() * torch.eye(d, dtype=torch.float64)
    cov = cov + 1e-3 * torch.eye(d, dtype=torch.float64) * (structure != "rank1")
    cov = 0.5 * (cov + cov.T)  # a @ a.T is not bitwise symmetric; linear layers symmetrise too
    return mean.to(dtype), (var_scale * cov).to(dtype)


def _assert_finite_with_grads(fn, mean, cov):
    mean = mean.clone().requires_grad_()
    cov = cov.clone().requires_grad_()
    out_mean, out_cov = fn(mean, cov)
    assert torch.isfinite(out_mean).all() and torch.isfinite(out_cov).all()
    g_mean, g_cov = torch.autograd.grad(out_mean.sum() + out_cov.sum(), (mean, cov))
    assert torch.isfinite(g_mean).all() and torch.isfinite(g_cov).all()
    return out_mean.detach(), out_cov.detach()


def _min_rel_eig(cov):
    ev = torch.linalg.eigvalsh(cov.double())
    return (ev.min() / ev.max().clamp_min(1e-300)).item()


@SETTINGS
@given(gaussians(), FNS)
def test_activation_outputs_finite_with_finite_gradients(g, name):
    mean, cov = g
    _, out_cov = _assert_finite_with_grads(_fn(name), mean, cov)
    torch.testing.assert_close(out_cov, out_cov.T, rtol=0, atol=0)
    assert (out_cov.diagonal() >= 0).all()


@SETTINGS
@given(gaussians())
def test_relu_psd_even_for_singular_inputs(g):
    mean, cov = g
    _, out_cov = relu_full(mean, cov)
    assert _min_rel_eig(out_cov) >= -1e-4


@SETTINGS
@given(gaussians(min_diag_share=0.01), FNS)
def test_psd_up_to_round_off_for_nonsingular_inputs(g, name):
    mean, cov = g
    _, out_cov = _fn(name)(mean, cov)
    tol = 1e-12 if cov.dtype == torch.float64 else 1e-5
    assert _min_rel_eig(out_cov) >= -tol


@SETTINGS
@given(gaussians())
def test_relu_diag_matches_full_diagonal(g):
    mean, cov = g
    m_d, v_d = relu_diag(mean, cov.diagonal())
    m_f, c_f = relu_full(mean, cov)
    torch.testing.assert_close(m_d, m_f)
    torch.testing.assert_close(v_d, c_f.diagonal())


@settings(max_examples=25, deadline=None)
@given(
    DTYPES,
    FNS,
    st.sampled_from([1e-3, 1.0, 1e4]),
    st.integers(0, 1000),
    st.booleans(),
)
def test_network_outputs_finite_symmetric_psd(dtype, act, x_scale, seed, residual):
    torch.manual_seed(seed)
    net = mlp(3, [8, 8], 2, activation=act, residual=residual).to(dtype)
    x = x_scale * torch.randn(6, 3, dtype=dtype)
    out = net(x, mode="full")
    loss = out.mean.sum() + out.cov.sum()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in net.parameters())
    assert torch.isfinite(out.cov).all()
    torch.testing.assert_close(out.cov, out.cov.transpose(-1, -2))
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    assert min(_min_rel_eig(c) for c in out.cov) >= -tol


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 1000), st.sampled_from(["full", "diag"]))
def test_results_invariant_to_batch_order(seed, mode):
    torch.manual_seed(seed)
    net = mlp(2, [6, 6], 2, residual=True).double()
    x = torch.randn(9, 2, dtype=torch.float64)
    perm = torch.randperm(9)
    a, b = net(x, mode=mode), net(x[perm], mode=mode)
    torch.testing.assert_close(a.mean[perm], b.mean)
    torch.testing.assert_close(a.var[perm], b.var)


def test_gaussian_round_trip_keeps_marginals():
    g = Gaussian(torch.randn(3, 4), var=torch.rand(3, 4))
    torch.testing.assert_close(g.to_full().to_diag().var, g.var)
