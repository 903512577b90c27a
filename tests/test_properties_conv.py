"""Property tests (hypothesis) for the conv and pooling moments at the dense core's edges.

Huge means, tiny variances, float32 and float64: outputs and gradients stay finite, variances
non-negative, and the maximum of Gaussians respects its exact bounds
(:math:`E\\max \\ge \\max_i m_i` and, by the Gaussian Poincare inequality,
:math:`\\operatorname{Var}\\max \\le \\max_i v_i`).
"""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_dvi.moments import (
    avg_pool2d_diag,
    conv2d_diag,
    max_of_gaussians,
    max_of_gaussians_quadrature,
    max_pool2d_diag,
)

SETTINGS = settings(max_examples=40, deadline=None)


@st.composite
def images(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mean_scale = draw(st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e4]))
    var_scale = draw(st.sampled_from([0.0, 1e-12, 1e-6, 1.0, 1e3]))
    shape = (2, 2, 4, 4)
    mean = mean_scale * torch.randn(shape, generator=gen, dtype=torch.float64)
    var = var_scale * torch.rand(shape, generator=gen, dtype=torch.float64)
    return mean.to(dtype), var.to(dtype)


def _finite_with_grads(fn, mean, var):
    mean = mean.clone().requires_grad_()
    var = var.clone().requires_grad_()
    out_mean, out_var = fn(mean, var)
    assert torch.isfinite(out_mean).all() and torch.isfinite(out_var).all()
    assert (out_var >= 0).all()
    grads = torch.autograd.grad(out_mean.sum() + out_var.sum(), (mean, var))
    assert all(torch.isfinite(g).all() for g in grads)
    return out_mean.detach(), out_var.detach()


@SETTINGS
@given(images(), st.sampled_from(["conv", "avg", "max", "clark"]))
def test_conv_and_pool_moments_finite_with_finite_gradients(img, op):
    mean, var = img
    w_loc = torch.randn(3, 2, 3, 3, dtype=mean.dtype) / 4
    w_var = torch.rand(3, 2, 3, 3, dtype=mean.dtype) / 10
    fns = {
        "conv": lambda m, v: conv2d_diag(m, v, w_loc, w_var, padding=1),
        "avg": lambda m, v: avg_pool2d_diag(m, v, 2),
        "max": lambda m, v: max_pool2d_diag(m, v, 2),
        "clark": lambda m, v: max_pool2d_diag(m, v, 2, method="clark"),
    }
    _finite_with_grads(fns[op], mean, var)


@SETTINGS
@given(images(), st.sampled_from(["quadrature", "clark"]))
def test_max_respects_its_bounds(img, method):
    mean, var = img
    m, v = mean.reshape(-1, 4).double(), var.reshape(-1, 4).double()
    if method == "quadrature":
        out_mean, out_var = max_of_gaussians_quadrature(m, v)
    else:
        out_mean, out_var = max_of_gaussians(m[:, 0], v[:, 0], m[:, 1], v[:, 1])
        m, v = m[:, :2], v[:, :2]
    scale = (m.abs().amax(-1) + v.amax(-1).sqrt()).clamp_min(1e-300)
    assert (out_mean >= m.amax(-1) - 1e-9 * scale).all()
    floor = torch.finfo(torch.float64).eps ** 2  # the documented variance floor
    assert (out_var <= v.amax(-1).clamp_min(floor) * (1 + 1e-6) + 1e-18 * scale**2).all()


@SETTINGS
@given(images())
def test_max_pool_is_symmetric_in_the_window(img):
    mean, var = img
    m, v = mean.reshape(-1, 4).double(), var.reshape(-1, 4).double()
    perm = torch.tensor([2, 0, 3, 1])
    a = max_of_gaussians_quadrature(m, v)
    b = max_of_gaussians_quadrature(m[:, perm], v[:, perm])
    scale = m.abs().amax() + v.amax().sqrt() + 1e-300
    torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=1e-12 * scale.item())
    torch.testing.assert_close(a[1], b[1], rtol=1e-9, atol=1e-12 * scale.item() ** 2)
