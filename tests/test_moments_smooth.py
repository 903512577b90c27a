"""LeakyReLU, ELU, GELU, SiLU, Softplus, Tanh and Sigmoid moments against quadrature, 2-D
quadrature and Monte Carlo over weights."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import integrate, special

from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.moments import elu as E
from lightning_dvi.moments import smooth as S
from lightning_dvi.nn import (
    ELU,
    GELU,
    BayesLinear,
    LeakyReLU,
    Residual,
    Sequential,
    Sigmoid,
    SiLU,
    Softplus,
    Tanh,
)

_K = math.sqrt(2 / math.pi)


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(_K * (x + 0.044715 * x**3)))


# name -> (f, f', diag, full, slope); numpy f for the oracles, torch functions under test
FUNCS = {
    "leaky_relu": (
        lambda x: np.where(x > 0, x, 0.1 * x),
        lambda x: np.where(x > 0, 1.0, 0.1),
        lambda m, v: S.leaky_relu_diag(m, v, 0.1),
        lambda m, c: S.leaky_relu_full(m, c, 0.1),
        lambda m, v: S.leaky_relu_slope(m, v, 0.1),
    ),
    "gelu": (
        lambda x: x * special.ndtr(x),
        lambda x: special.ndtr(x) + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi),
        S.gelu_diag,
        S.gelu_full,
        S.gelu_slope,
    ),
    "silu": (
        lambda x: x * special.expit(x),
        lambda x: special.expit(x) * (1 + x * (1 - special.expit(x))),
        S.silu_diag,
        S.silu_full,
        S.silu_slope,
    ),
    "tanh": (np.tanh, lambda x: 1 - np.tanh(x) ** 2, S.tanh_diag, S.tanh_full, S.tanh_slope),
    "elu": (
        lambda x: np.where(x > 0, x, 0.7 * np.expm1(np.minimum(x, 0))),
        lambda x: np.where(x > 0, 1.0, 0.7 * np.exp(np.minimum(x, 0))),
        lambda m, v: E.elu_diag(m, v, 0.7),
        lambda m, c: E.elu_full(m, c, 0.7),
        lambda m, v: E.elu_slope(m, v, 0.7),
    ),
    "softplus": (
        lambda x: np.logaddexp(0, 2 * x) / 2,
        lambda x: special.expit(2 * x),
        lambda m, v: S.softplus_diag(m, v, 2.0),
        lambda m, c: S.softplus_full(m, c, 2.0),
        lambda m, v: S.softplus_slope(m, v, 2.0),
    ),
    "sigmoid": (
        special.expit,
        lambda x: special.expit(x) * (1 - special.expit(x)),
        S.sigmoid_diag,
        S.sigmoid_full,
        S.sigmoid_slope,
    ),
}


def _quad(g, m, s):
    """E[g(a)], a ~ N(m, s^2), by adaptive quadrature (kinks at 0 split out)."""
    lo, hi = m - 14 * s, m + 14 * s
    pts = [0.0] if lo < 0 < hi else None
    c = 1 / (s * np.sqrt(2 * np.pi))
    val, _ = integrate.quad(
        lambda x: g(x) * c * np.exp(-0.5 * ((x - m) / s) ** 2),
        lo,
        hi,
        points=pts,
        limit=400,
        epsrel=1e-12,
    )
    return val


# (m, s) grid: sd from tiny to wide, means on the scale of the sd and of the nonlinearity
GRID = [(m, s) for s in (1e-3, 0.3, 0.9, 1.1, 2.5, 6.0) for m in (-4.0, -1.0, 0.0, 0.7, 3.0)]


@pytest.mark.parametrize("name", list(FUNCS))
def test_mean_variance_slope_within_1e4_of_quadrature(name):
    f, df, diag, _, slope = FUNCS[name]
    m_t = torch.tensor([m * max(s, 1) for m, s in GRID], dtype=torch.float64)
    v_t = torch.tensor([s * s for _, s in GRID], dtype=torch.float64)
    out_mean, out_var = diag(m_t, v_t)
    out_slope = slope(m_t, v_t)
    for i, (_, s) in enumerate(GRID):
        m = m_t[i].item()
        e1 = _quad(f, m, s)
        var = _quad(lambda x, e1=e1: (f(x) - e1) ** 2, m, s)
        e_slope = _quad(df, m, s)
        # relative 1e-4, with an absolute floor of 1e-10 sd for means that are exactly ~0
        assert abs(out_mean[i].item() - e1) <= 1e-4 * abs(e1) + 1e-10 * s, (name, m, s)
        assert out_var[i].item() == pytest.approx(var, rel=1e-4), (name, m, s)
        assert out_slope[i].item() == pytest.approx(e_slope, rel=1e-4, abs=1e-12), (name, m, s)


def _pair_cov_2d(f, m, cov, n=160):
    """Cov(f(a1), f(a2)) by a 2-D Gauss–Hermite product rule on the Cholesky factor."""
    z, w = np.polynomial.hermite_e.hermegauss(n)
    w = w / w.sum()
    chol = np.linalg.cholesky(cov)
    z1, z2 = np.meshgrid(z, z, indexing="ij")
    a1 = m[0] + chol[0, 0] * z1
    a2 = m[1] + chol[1, 0] * z1 + chol[1, 1] * z2
    ww = np.outer(w, w)
    f1, f2 = f(a1), f(a2)
    e1, e2 = (ww * f1).sum(), (ww * f2).sum()
    return (ww * (f1 - e1) * (f2 - e2)).sum()


def _leaky_pair_cov(m, cov, alpha=0.1):
    """Cov of LeakyReLU outputs by 1-D quadrature over a1, exact conditional mean of f(a2)."""
    s1, s2 = np.sqrt(np.diag(cov))
    r = cov[0, 1] / (s1 * s2)
    cs = s2 * np.sqrt(1 - r * r)

    def f(x):
        return np.where(x > 0, x, alpha * x)

    def cond_mean(a1):
        cm = m[1] + r * s2 / s1 * (a1 - m[0])
        z = cm / cs
        relu = cm * special.ndtr(z) + cs * np.exp(-0.5 * z * z) / np.sqrt(2 * np.pi)
        return alpha * cm + (1 - alpha) * relu

    joint = _quad(lambda a1: f(a1) * cond_mean(a1), m[0], s1)
    return joint - _quad(f, m[0], s1) * _quad(f, m[1], s2)


def _random_pairs(seed, n):
    rng = np.random.default_rng(seed)
    for _ in range(n):
        s = np.exp(rng.uniform(np.log(0.05), np.log(1.5), 2))
        rho = rng.uniform(-0.99, 0.99)
        m = rng.normal(0, 1.5, 2)
        cov = np.array([[s[0] ** 2, rho * s[0] * s[1]], [rho * s[0] * s[1], s[1] ** 2]])
        yield m, cov


# measured worst |error| / (sd_1 sd_2) over 200 random pairs (docs/moments.md), plus headroom
OFF_DIAGONAL_BOUND = {
    "leaky_relu": 4e-3,  # (1 - alpha)^2 times the ReLU form's error
    "gelu": 2e-3,
    "silu": 1e-3,
    "tanh": 4e-3,
    "sigmoid": 1e-4,
    "elu": 4e-3,
    "softplus": 1e-3,
}


@pytest.mark.parametrize("name", list(FUNCS))
def test_off_diagonal_within_documented_bound_of_2d_quadrature(name):
    f, _, _, full, _ = FUNCS[name]
    worst = 0.0
    for m, cov in _random_pairs(seed=3, n=25):
        _, out = full(torch.tensor(m), torch.tensor(cov))
        ref = _leaky_pair_cov(m, cov) if name == "leaky_relu" else _pair_cov_2d(f, m, cov)
        sd = np.sqrt(np.diag(cov))
        worst = max(worst, abs(out[0, 1].item() - ref) / (sd[0] * sd[1]))
    assert worst <= OFF_DIAGONAL_BOUND[name], worst


KERNELS = {
    "gelu": (S.GELU_KERNEL, (1.0, 1.0, 0.0)),
    "silu": (S.SILU_KERNEL, (1.0, 1.0, 0.0)),
    "tanh": (S.SIGMOID_KERNEL, (2.0, 2.0, -1.0)),
    "sigmoid": (S.SIGMOID_KERNEL, (1.0, 1.0, 0.0)),
    "softplus": (S.SOFTPLUS_KERNEL, (2.0, 0.5, 0.0)),
}


@pytest.mark.parametrize("name", list(KERNELS))
def test_mehler_tail_bound_holds(name):
    """The Cauchy–Schwarz bound on the truncated series covers the actual error."""
    f, *_ = FUNCS[name]
    kernel, scale = KERNELS[name]
    for m, cov in _random_pairs(seed=4, n=15):
        mt, ct = torch.tensor(m), torch.tensor(cov)
        _, out_var, *derivs = S.smooth_moments(kernel, mt, ct.diagonal(), 3, None, scale)
        derivs = torch.stack(derivs, -1)
        bound = S.mehler_tail_bound(derivs, out_var, ct)[0, 1].item()
        approx = S.mehler_cov(ct, derivs, out_var)[0, 1].item()
        # slack: the quadrature's own error in V and e_k (1e-5 relative, docs/moments.md)
        slack = 1e-5 * np.sqrt(out_var[0].item() * out_var[1].item())
        assert abs(approx - _pair_cov_2d(f, m, cov)) <= bound + slack


@pytest.mark.parametrize("name", list(FUNCS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_full_diagonal_equals_diag_and_is_psd(name, dtype):
    *_, diag, full, _ = FUNCS[name]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(3, 6, 6, generator=gen, dtype=torch.float64)
    cov = (a @ a.transpose(-1, -2) / 6 + 0.01 * torch.eye(6, dtype=torch.float64)).to(dtype)
    mean = torch.randn(3, 6, generator=gen, dtype=torch.float64).to(dtype)
    m_f, c_f = full(mean, cov)
    m_d, v_d = diag(mean, cov.diagonal(dim1=-2, dim2=-1))
    assert m_f.dtype == dtype and c_f.dtype == dtype
    torch.testing.assert_close(m_f, m_d)
    torch.testing.assert_close(c_f.diagonal(dim1=-2, dim2=-1), v_d)
    torch.testing.assert_close(c_f, c_f.transpose(-1, -2), rtol=0, atol=0)
    ev = torch.linalg.eigvalsh(c_f.double())
    assert (ev.min(-1).values >= -1e-6 * ev.max(-1).values).all()


def test_first_layer_output_stays_diagonal_in_full_mode():
    """A diagonal input covariance (rho = 0) gives an exactly diagonal output."""
    mean = torch.randn(4, 5, dtype=torch.float64)
    cov = torch.diag_embed(torch.rand(4, 5, dtype=torch.float64) + 0.1)
    for name in FUNCS:
        _, out = FUNCS[name][3](mean, cov)
        off = out - torch.diag_embed(out.diagonal(dim1=-2, dim2=-1))
        assert off.abs().max().item() == 0.0, name


# -------------------------------------------------------------------------------- modules
MODULES = {
    "leaky_relu": lambda: LeakyReLU(0.1),
    "elu": lambda: ELU(0.7),
    "softplus": lambda: Softplus(2.0),
    "gelu": GELU,
    "gelu_tanh": lambda: GELU("tanh"),
    "silu": SiLU,
    "tanh": Tanh,
    "sigmoid": Sigmoid,
}


@pytest.mark.parametrize("name", list(MODULES))
def test_modules_match_torch_at_zero_variance_and_in_sample_mode(name):
    act = MODULES[name]()
    x = torch.linspace(-6, 6, 25, dtype=torch.float64).reshape(5, 5)
    from lightning_dvi import Gaussian

    for mode, g in (
        ("diag", Gaussian(x, var=torch.zeros_like(x))),
        ("full", Gaussian(x, cov=torch.zeros(5, 5, 5, dtype=torch.float64))),
    ):
        out = act(g, mode=mode)
        torch.testing.assert_close(out.mean, act.apply(x), rtol=0, atol=1e-12)
        assert out.var.abs().max().item() <= 1e-12
    assert torch.equal(act(x, mode="sample", num_samples=2), act.apply(x).expand(2, 5, 5))


def test_gelu_tanh_module_is_handled_and_bad_variant_rejected():
    assert GELU("tanh").approximate == "tanh"
    with pytest.raises(ValueError, match="approximate"):
        GELU("fast")
    with pytest.raises(ValueError, match="num_nodes"):
        SiLU(num_nodes=1)
    with pytest.raises(ValueError, match="negative_slope"):
        LeakyReLU(float("nan"))
    with pytest.raises(ValueError, match="alpha"):
        ELU(float("nan"))
    with pytest.raises(ValueError, match="beta"):
        Softplus(beta=0.0)


def _net(act, width=16, seed=0):
    torch.manual_seed(seed)
    return Sequential(
        BayesLinear(4, width, init_scale=0.3),
        act(),
        BayesLinear(width, width, init_scale=0.3),
        act(),
        BayesLinear(width, 3, init_scale=0.3),
    ).double()


@pytest.mark.parametrize("init_scale", [None, 0.3])
def test_three_layer_gelu_net_matches_20000_weight_draws(init_scale):
    """DVI (full): output mean within 0.05 MC sd and sd within 5 % of 20,000 weight draws."""
    kwargs = {} if init_scale is None else {"init_scale": init_scale}
    torch.manual_seed(0)
    net = Sequential(
        BayesLinear(4, 16, **kwargs),
        GELU(),
        BayesLinear(16, 16, **kwargs),
        GELU(),
        BayesLinear(16, 3, **kwargs),
    ).double()
    x = torch.randn(6, 4, dtype=torch.float64)
    torch.manual_seed(1)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=20_000, chunk_size=5_000)
    assert res.mean_error <= 0.05, res
    assert res.std_rel_error <= 0.05, res
    assert res.corr_error <= 0.05, res
    # dDVI drops the hidden correlations, which costs more than the activation's moments do
    torch.manual_seed(1)
    res = compare_with_monte_carlo(net, x, mode="diag", num_samples=20_000, chunk_size=5_000)
    assert res.mean_error <= 0.05 and res.std_rel_error <= 0.15, res


@pytest.mark.parametrize("name", ["leaky_relu", "silu", "tanh", "sigmoid", "elu", "softplus"])
def test_other_three_layer_nets_match_weight_draws(name):
    net = _net(MODULES[name])
    x = torch.randn(4, 4, dtype=torch.float64)
    torch.manual_seed(2)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=10_000, chunk_size=5_000)
    assert res.mean_error <= 0.06 and res.std_rel_error <= 0.06, res


@pytest.mark.parametrize("name", list(MODULES))
def test_residual_blocks_accept_the_activations(name):
    torch.manual_seed(0)
    net = Sequential(
        BayesLinear(3, 6, init_scale=0.3),
        Residual(MODULES[name](), BayesLinear(6, 6, init_scale=0.3)),
        BayesLinear(6, 2, init_scale=0.3),
    ).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=10_000, chunk_size=5_000)
    assert res.mean_error <= 0.06 and res.std_rel_error <= 0.06, res
    out = net(x, mode="diag")  # dDVI drops the correlations: only finiteness is checked here
    assert torch.isfinite(out.var).all() and (out.var > 0).all()


# ----------------------------------------------------------------------- property tests
DTYPES = st.sampled_from([torch.float32, torch.float64])


@st.composite
def gaussians(draw):
    d = draw(st.integers(1, 4))
    dtype = draw(DTYPES)
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    mean_scale = draw(st.sampled_from([0.0, 1e-3, 1.0, 30.0, 1e4]))
    var_scale = draw(st.sampled_from([0.0, 1e-12, 1e-6, 1.0, 1e3]))
    structure = draw(st.sampled_from(["diagonal", "rank1", "random"]))
    mean = mean_scale * torch.randn(d, generator=gen, dtype=torch.float64)
    if structure == "diagonal":
        cov = torch.diag(torch.rand(d, generator=gen, dtype=torch.float64) + 0.1)
    elif structure == "rank1":  # rho = +-1
        v = torch.randn(d, 1, generator=gen, dtype=torch.float64)
        cov = v @ v.T
    else:
        a = torch.randn(d, d, generator=gen, dtype=torch.float64)
        cov = a @ a.T / d + 1e-3 * torch.eye(d, dtype=torch.float64)
    cov = 0.5 * (cov + cov.T)
    return mean.to(dtype), (var_scale * cov).to(dtype)


@settings(max_examples=40, deadline=None)
@given(gaussians(), st.sampled_from(list(FUNCS)))
def test_finite_values_and_gradients_at_edges(g, name):
    *_, diag, full, slope = FUNCS[name]
    mean = g[0].clone().requires_grad_()
    cov = g[1].clone().requires_grad_()
    out_mean, out_cov = full(mean, cov)
    d_mean, d_var = diag(mean, cov.diagonal())
    sl = slope(mean, cov.diagonal())
    for t in (out_mean, out_cov, d_mean, d_var, sl):
        assert torch.isfinite(t).all(), name
    assert (out_cov.diagonal() >= 0).all() and (d_var >= 0).all()
    torch.testing.assert_close(out_cov, out_cov.T, rtol=0, atol=0)
    loss = out_mean.sum() + out_cov.sum() + d_var.sum() + sl.sum()
    g_mean, g_cov = torch.autograd.grad(loss, (mean, cov))
    assert torch.isfinite(g_mean).all() and torch.isfinite(g_cov).all(), name


# ------------------------------------------------------------- closed-form backward passes
# means and spreads that reach both rules and both signs (the reflection)
_GC_MEAN = [-6.0, -1.2, -0.3, 0.0, 0.4, 2.5, 7.0, -3.0, 1.0]
_GC_VAR = [0.04, 0.3, 1e-4, 0.5, 2.0, 0.09, 9.0, 6.0, 30.0]


@pytest.mark.parametrize("name", list(FUNCS))
def test_closed_form_gradients_match_finite_differences(name):
    """Stein's-lemma gradients are those of the exact moments; the quadrature's own finite
    differences differ from them by its error near the rule switch (up to ~2e-3), a wrong
    formula by O(1)."""
    *_, diag, full, slope = FUNCS[name]
    mean = torch.tensor(_GC_MEAN, dtype=torch.float64, requires_grad=True)
    var = torch.tensor(_GC_VAR, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(diag, (mean, var), atol=1e-6, rtol=5e-3)
    assert torch.autograd.gradcheck(slope, (mean, var), atol=1e-6, rtol=5e-3)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(2, 4, 4, generator=gen, dtype=torch.float64)
    cov = (a @ a.mT / 4 + 0.2 * torch.eye(4, dtype=torch.float64)).requires_grad_()
    m = torch.randn(2, 4, generator=gen, dtype=torch.float64, requires_grad=True)

    def full_sym(m, c):  # the covariance is symmetric: perturb it symmetrically
        return full(m, 0.5 * (c + c.mT))

    assert torch.autograd.gradcheck(full_sym, (m, cov), atol=1e-6, rtol=5e-3)


@pytest.mark.parametrize("name", ["sigmoid", "silu", "gelu", "softplus", "tanh"])
def test_cpu_partition_and_whole_tensor_paths_agree(name):
    """The policy's two executions of one formula: per-unit rule (CPU) and where-selected."""
    from lightning_dvi.moments import kernel_backend

    *_, diag, _, slope = FUNCS[name]
    gen = torch.Generator().manual_seed(2)
    mean = 3 * torch.randn(200, generator=gen, dtype=torch.float64)
    var = torch.exp(4 * torch.rand(200, generator=gen, dtype=torch.float64) - 3)
    with kernel_backend("blocked"):
        ref = (*diag(mean, var), slope(mean, var))
    with kernel_backend("whole"):
        got = (*diag(mean, var), slope(mean, var))
    for r, g in zip(ref, got, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-10)


def test_scratch_pool_is_reused_and_bounded():
    from lightning_dvi.moments import _quadrature as Q

    mean, var = torch.randn(300), torch.rand(300) * 0.1
    S.sigmoid_diag(mean, var)
    pool = dict(Q._POOL.buffers)
    S.sigmoid_diag(mean, var)
    assert {k: v.data_ptr() for k, v in Q._POOL.buffers.items()} == {
        k: v.data_ptr() for k, v in pool.items()
    }
    assert all(v.numel() <= Q.POOL_LIMIT for v in Q._POOL.buffers.values())


@pytest.mark.parametrize(
    "kernel", [S.SIGMOID_KERNEL, S.SILU_KERNEL, S.SOFTPLUS_KERNEL, S.GELU_KERNEL]
)
def test_float32_spread_at_the_rounded_switch_terminates(kernel):
    """A float32 variance equal to the switch's square rounded (1.2^2 for GELU) is narrow in
    float32 but above the switch in float64: the CPU split once recursed without end on it."""
    from lightning_dvi.moments import kernel_backend
    from lightning_dvi.moments._quadrature import smooth_moments

    sd = torch.tensor([kernel.switch, 0.5 * kernel.switch, 2 * kernel.switch], dtype=torch.float64)
    var = (sd * sd).float()
    mean = torch.tensor([-1.0, 0.5, 2.0])
    with kernel_backend("blocked"):
        got = smooth_moments(kernel, mean, var)
        ref = smooth_moments(kernel, mean.double(), var.double())
    torch.testing.assert_close(got[0].double(), ref[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[1].double(), ref[1], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(FUNCS))
def test_zero_variance_far_from_the_kink_has_finite_gradients(name, dtype):
    """Hypothesis found it for ELU: mean 46.23, variance 0, float32 gave a NaN covariance
    gradient (He_j(m / s) overflowed against a zero density, and Mehler's shrink divided by a
    floored zero in its unselected branch)."""
    *_, diag, full, slope = FUNCS[name]
    mean = torch.tensor([46.23, -46.0, 5e3, 0.5], dtype=dtype, requires_grad=True)
    cov = torch.zeros(4, 4, dtype=dtype, requires_grad=True)
    out_mean, out_cov = full(mean, cov)
    d_mean, d_var = diag(mean, cov.diagonal())
    loss = out_mean.sum() + out_cov.sum() + d_mean.sum() + d_var.sum()
    loss = loss + slope(mean, cov.diagonal()).sum()
    g_mean, g_cov = torch.autograd.grad(loss, (mean, cov))
    assert torch.isfinite(g_mean).all() and torch.isfinite(g_cov).all(), name
