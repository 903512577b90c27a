"""GELU's closed-form moment rule (``rule="closed"``) against independent oracles: adaptive
quadrature (scipy), Owen's T function (scipy), Monte Carlo draws, and the quadrature engine it
stands in for (``docs/moments.md``, ``docs/transformer_benchmark.md``)."""

import math

import numpy as np
import pytest
import torch
from scipy import integrate, special
from torch import nn
from transformer_models import TinyViT, randomize_norms

from lightning_dvi import Gaussian
from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.moments import smooth as S
from lightning_dvi.nn import GELU, BayesLinear, Residual, Sequential, posthoc


def _gelu(x):
    return x * special.ndtr(x)


def _dgelu(x):
    return special.ndtr(x) + x * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)


def _quad(g, m, s):
    """E[g(a)], a ~ N(m, s^2), adaptive quadrature over m +- 14 s (0 split out)."""
    lo, hi = m - 14 * s, m + 14 * s
    c = 1 / (s * np.sqrt(2 * np.pi))
    val, _ = integrate.quad(
        lambda x: g(x) * c * np.exp(-0.5 * ((x - m) / s) ** 2),
        lo,
        hi,
        points=[0.0] if lo < 0 < hi else None,
        limit=400,
        epsrel=1e-13,
        epsabs=0,
    )
    return val


# means across the kink and far into both tails, sds from tiny to far wider than the kink
GRID = [
    (m, s)
    for m in (-8.0, -4.0, -2.0, -0.75, -0.3, 0.0, 0.5, 1.0, 3.0, 8.0)
    for s in (1e-4, 1e-2, 0.3, 0.7, 1.5, 6.0)
]


def _oracle(m, s):
    mean = _quad(_gelu, m, s)
    return mean, _quad(lambda x: (_gelu(x) - mean) ** 2, m, s), _quad(_dgelu, m, s)


def _grid(dtype=torch.float64):
    return (
        torch.tensor([m for m, _ in GRID], dtype=dtype),
        torch.tensor([s * s for _, s in GRID], dtype=dtype),
    )


@pytest.fixture(scope="module")
def oracle():
    return np.array([_oracle(m, s) for m, s in GRID])


def test_float64_mean_variance_slope_against_adaptive_quadrature(oracle):
    """Mean and slope exact (1e-10), variance within 1e-6 relative (measured: 2e-11)."""
    m, v = _grid()
    mean, var = S.gelu_closed_diag(m, v)
    slope = S.gelu_closed_slope(m, v)
    np.testing.assert_allclose(mean.numpy(), oracle[:, 0], rtol=1e-10, atol=1e-300)
    np.testing.assert_allclose(var.numpy(), oracle[:, 1], rtol=1e-6)
    np.testing.assert_allclose(slope.numpy(), oracle[:, 2], rtol=1e-10)


def test_float32_within_rounding_of_the_oracle(oracle):
    """float32: mean and slope within 1e-5 relative, variance within 1e-4 relative plus 1e-6 of the input
    variance (where GELU' ~ 0 the variance is O(v^2) and float32 cancels O(v) terms)."""
    m, v = _grid(torch.float32)
    mean, var = S.gelu_closed_diag(m, v)
    slope = S.gelu_closed_slope(m, v)
    v64 = v.double().numpy()
    ok = oracle[:, 1] > 1e-25  # float32 flushes below 1e-31
    np.testing.assert_allclose(mean.double().numpy(), oracle[:, 0], rtol=1e-5, atol=1e-30)
    # the slope crosses 0 at -0.7518: float32 rounds its two O(1) terms to 1e-8
    np.testing.assert_allclose(slope.double().numpy(), oracle[:, 2], rtol=1e-5, atol=5e-8)
    err = np.abs(var.double().numpy() - oracle[:, 1])[ok]
    assert np.all(err <= 1e-4 * oracle[ok, 1] + 1e-6 * v64[ok]), err.max()


@pytest.mark.parametrize("h", [-6.0, -2.5, -0.4, 0.0, 1.3, 4.0])
@pytest.mark.parametrize("v", [1e-6, 0.05, 1.0, 30.0])
def test_bivariate_piece_against_owens_t(h, v):
    r"""Phi_2(h, h; rho) - Phi(h)^2 with rho = v/(1+v) equals Phi(h) - 2 T(h, a) - Phi(h)^2,
    a = 1/sqrt(1+2v) (scipy's Owen's T), to 1e-9 relative."""
    q = math.sqrt(1 + 2 * v)
    t = torch.tensor([h], dtype=torch.float64)
    got = S._gelu_phi2_excess(
        t, torch.tensor([v], dtype=torch.float64), torch.tensor([q], dtype=torch.float64)
    )
    cdf = special.ndtr(h)
    want = cdf - 2 * special.owens_t(h, 1 / q) - cdf * cdf
    # the subtraction costs digits where Phi(h) >> the excess (scipy's T is good to ~1e-14
    # relative): compare to that rounding
    assert got.item() == pytest.approx(want, rel=1e-8, abs=1e-13 * cdf)


def test_against_the_quadrature_engine_at_its_tolerance():
    """The quadrature rule (the library's oracle before) agrees to its own 1e-4 where that rule
    is documented (|m| <= 4; at m = -8 it is off by up to 1e-3 in the variance, and the closed
    form is the accurate one: the test above)."""
    m, v = _grid()
    keep = m.abs() <= 4
    m, v = m[keep], v[keep]
    mean, var = S.gelu_closed_diag(m, v)
    q_mean, q_var = S.gelu_diag(m, v)
    torch.testing.assert_close(mean, q_mean, rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(var, q_var, rtol=2e-4, atol=0)
    torch.testing.assert_close(S.gelu_closed_slope(m, v), S.gelu_slope(m, v), rtol=1e-4, atol=0)


def test_monte_carlo_draws():
    """Mean within 4 standard errors and variance within 2 % of 400,000 draws."""
    gen = torch.Generator().manual_seed(0)
    m = torch.tensor([-1.5, -0.5, 0.2, 1.0, 2.5], dtype=torch.float64)
    v = torch.tensor([0.04, 0.5, 2.0, 0.3, 9.0], dtype=torch.float64)
    draws = m + v.sqrt() * torch.randn(400_000, 5, generator=gen, dtype=torch.float64)
    h = nn.functional.gelu(draws)
    mean, var = S.gelu_closed_diag(m, v)
    se = h.std(0) / math.sqrt(h.shape[0])
    assert torch.all((mean - h.mean(0)).abs() <= 4 * se)
    torch.testing.assert_close(var, h.var(0), rtol=0.02, atol=0)
    # Stein: Cov(a, GELU(a)) = v E[GELU'(a)]
    cov = ((draws - draws.mean(0)) * (h - h.mean(0))).mean(0)
    torch.testing.assert_close(v * S.gelu_closed_slope(m, v), cov, rtol=0.02, atol=0)


def test_full_mode_coefficients_and_covariance():
    """Closed-form Mehler coefficients e_2, e_3 against quadrature; the full covariance equals
    the diag rule on its diagonal, is PSD, and is within 1e-4 of the quadrature rule's."""
    m, s = 0.4, 0.8
    d2 = lambda x: (2 - x * x) * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)  # noqa: E731
    d3 = lambda x: (x**3 - 4 * x) * np.exp(-0.5 * x * x) / np.sqrt(2 * np.pi)  # noqa: E731
    torch.manual_seed(0)
    a = torch.randn(5, 5, dtype=torch.float64)
    cov = a @ a.T / 5 + 0.1 * torch.eye(5, dtype=torch.float64)
    mean = torch.linspace(-1.0, 1.0, 5, dtype=torch.float64)
    out_mean, out_cov = S.gelu_closed_full(mean, cov)
    d_mean, d_var = S.gelu_closed_diag(mean, cov.diagonal())
    torch.testing.assert_close(out_mean, d_mean, rtol=0, atol=0)
    torch.testing.assert_close(out_cov.diagonal(), d_var, rtol=1e-12, atol=1e-15)
    assert torch.linalg.eigvalsh(out_cov).min() > -1e-12
    _, q_cov = S.gelu_full(mean, cov)
    torch.testing.assert_close(out_cov, q_cov, rtol=1e-4, atol=1e-6)
    # the coefficients themselves: compare a 2x2 covariance's off-diagonal to the series
    c2 = torch.tensor([[s * s, 0.1], [0.1, s * s]], dtype=torch.float64)
    _, out = S.gelu_closed_full(torch.tensor([m, m], dtype=torch.float64), c2)
    e = [_quad(_dgelu, m, s), _quad(d2, m, s), _quad(d3, m, s)]
    series = sum(0.1**k * e[k - 1] ** 2 / math.factorial(k) for k in (1, 2, 3))
    assert out[0, 1].item() == pytest.approx(series, rel=1e-9)


def test_gradients_match_finite_differences():
    torch.manual_seed(0)
    mean = torch.randn(7, dtype=torch.float64, requires_grad=True)
    var = (0.1 + torch.rand(7, dtype=torch.float64)).requires_grad_(True)
    assert torch.autograd.gradcheck(S.gelu_closed_diag, (mean, var))
    assert torch.autograd.gradcheck(S.gelu_closed_slope, (mean, var))


def test_zero_variance_is_the_function_and_gradients_finite():
    for dtype, tol in ((torch.float64, 1e-14), (torch.float32, 1e-6)):
        m = torch.linspace(-9, 9, 37, dtype=dtype, requires_grad=True)
        v = torch.zeros(37, dtype=dtype, requires_grad=True)
        mean, var = S.gelu_closed_diag(m, v)
        torch.testing.assert_close(mean, nn.functional.gelu(m), rtol=tol, atol=tol)
        assert torch.all(var == 0)
        (mean.sum() + var.sum() + S.gelu_closed_slope(m, v).sum()).backward()
        assert torch.isfinite(m.grad).all() and torch.isfinite(v.grad).all()


def test_module_rule_and_its_checks():
    g = GELU(rule="closed")
    x = Gaussian(torch.tensor([[0.3, -1.0]]), var=torch.tensor([[0.2, 0.5]]))
    out = g(x, mode="diag")
    mean, var = S.gelu_closed_diag(x.mean, x.var)
    torch.testing.assert_close(out.mean, mean, rtol=0, atol=0)
    torch.testing.assert_close(out.var, var, rtol=0, atol=0)
    assert "rule='closed'" in repr(g) and "rule" not in repr(GELU())
    with pytest.raises(ValueError, match="exact GELU"):
        GELU("tanh", rule="closed")
    with pytest.raises(ValueError, match="rule must be one of"):
        GELU(rule="fast")  # type: ignore[arg-type]


def test_residual_net_with_closed_rule_matches_weight_draws():
    """A residual GELU block (the skip's cross-covariance through GELU's closed slope) in diag
    mode: within 0.05 MC sd on the mean and 5 % on the sd of 20,000 weight draws."""
    torch.manual_seed(0)
    net = Sequential(
        BayesLinear(3, 8, init_scale=0.3),
        Residual(BayesLinear(8, 16, init_scale=0.3), GELU(rule="closed"), BayesLinear(16, 8)),
        BayesLinear(8, 2, init_scale=0.3),
    ).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    torch.manual_seed(1)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=20_000, chunk_size=5_000)
    assert res.mean_error <= 0.05 and res.std_rel_error <= 0.05, res


def test_set_rules_and_posthoc_conversion_on_a_vit():
    """``gelu_rule="closed"`` through from_torch_posterior: every exact GELU switched, the
    predictive within 1e-6 of the quadrature rule's (float64); tanh GELUs keep the quadrature."""
    torch.manual_seed(0)
    model = randomize_norms(TinyViT(layers=1)).double().eval()
    std = {n: 0.05 * p.detach().abs() for n, p in model.named_parameters()}
    quad = posthoc.from_torch_posterior(model, std, attention_rule="mean")
    closed = posthoc.from_torch_posterior(model, std, attention_rule="mean", gelu_rule="closed")
    rules = [m.rule for m in closed.modules() if isinstance(m, GELU)]
    assert rules == ["closed"]
    x = torch.randn(3, 4, 16, dtype=torch.float64)
    with torch.no_grad():
        a, b = quad(x, mode="diag"), closed(x, mode="diag")
    torch.testing.assert_close(b.mean, a.mean, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(b.var, a.var, rtol=1e-5, atol=1e-12)
    assert posthoc.set_rules(closed, gelu_rule="quadrature") == 1
    assert all(m.rule == "quadrature" for m in closed.modules() if isinstance(m, GELU))
    tanh = Sequential(BayesLinear(2, 3), GELU("tanh"), BayesLinear(3, 1), GELU())
    assert posthoc.set_rules(tanh, gelu_rule="closed") == 1
    assert (tanh[1].rule, tanh[3].rule) == ("quadrature", "closed")
    with pytest.raises(ValueError, match="rule must be one of"):
        posthoc.set_rules(tanh, gelu_rule="probit")  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_in_place_path_equals_the_autograd_path(dtype):
    """Without autograd the formula runs in reused buffers: the same values as with it."""
    torch.manual_seed(0)
    m = 3 * torch.randn(4, 5, 33, dtype=dtype)
    v = torch.rand(4, 5, 33, dtype=dtype) * torch.logspace(-6, 1, 33, dtype=dtype)
    with torch.no_grad():
        fast = S.gelu_closed_diag(m, v)
        again = S.gelu_closed_diag(m, v)  # the buffers reused
    slow = S.gelu_closed_diag(m.requires_grad_(), v.requires_grad_())
    for a, b in zip(fast, again, strict=True):
        assert a.shape == m.shape and a.data_ptr() != b.data_ptr()
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the same operations, some in another order: rounding apart (relative to the input
    # variance where the O(v) terms of the variance cancel)
    eps = torch.finfo(dtype).eps
    torch.testing.assert_close(fast[0], slow[0].detach(), rtol=20 * eps, atol=20 * eps)
    err = (fast[1] - slow[1].detach()).abs()
    assert bool((err <= 100 * eps * (slow[1].detach() + v.detach())).all()), err.max()


@pytest.mark.parametrize("narrow", [True, False])
def test_buffered_excess_in_the_narrow_case_against_owens_t(narrow):
    """The predictive's buffered path: 5 nodes where every element has width <= 0.2 and
    R <= 1 (a posterior's small variances), 10 otherwise; both to 1e-10 of scipy's Owen's T."""
    h = torch.linspace(-12, 8, 81, dtype=torch.float64)
    v = torch.logspace(-8, -1, 81, dtype=torch.float64).flip(0)
    if narrow:  # keep R = h^2 v / (1 + 2v) <= 1 for every element
        v = torch.minimum(v, 0.9 / (h * h).clamp_min(1e-3))
    else:
        v = v.clone()
        v[40] = 3.0  # one wide element (h = -2): the whole tensor takes the full rule
    q = (1 + 2 * v).sqrt()
    width = 2 * v / (q * (q + 1))
    assert S._narrow(h, v, q, width) is narrow
    got = S._gelu_phi2_excess(h, v, q, S._Scratch(h, h.numel())).numpy()
    # the integral on [a, 1] itself by adaptive quadrature, in u = 1 - x on [0, 1 - a] with
    # 1 - a = 2v / (q (q + 1)) (Owen's T difference 2[T(h, 1) - T(h, a)] cancels to nothing at
    # these widths; it checks the wide element below)
    want = np.array(
        [
            integrate.quad(
                lambda u, hh=hh: (
                    math.exp(-hh * hh * (1 + (1 - u) ** 2) / 2) / (1 + (1 - u) ** 2) / math.pi
                ),
                0.0,
                ww,
                epsabs=0,
                epsrel=1e-13,
            )[0]
            for hh, ww in zip(h.tolist(), width.tolist(), strict=True)
        ]
    )
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=0)
    if not narrow:
        hh, qq = h[40].item(), q[40].item()
        cdf = special.ndtr(hh)
        assert got[40] == pytest.approx(
            2 * (special.owens_t(hh, 1.0) - special.owens_t(hh, 1 / qq)), rel=1e-8, abs=1e-13 * cdf
        )
    # and the moments through gelu_closed_diag: buffers (no autograd) against autograd's path
    m, var = h * (1 + v).sqrt(), v
    with torch.no_grad():
        fast = S.gelu_closed_diag(m, var)
    slow = S.gelu_closed_diag(m.requires_grad_(), var)
    torch.testing.assert_close(fast[0], slow[0].detach(), rtol=1e-12, atol=1e-300)
    torch.testing.assert_close(fast[1], slow[1].detach(), rtol=1e-9, atol=1e-300)


@pytest.mark.parametrize("v", [1e-6, 1e-3, 1e-2, 0.05, 0.1, 0.5])
def test_slope_rule_is_the_first_hermite_term(v):
    """``rule="slope"``: the closed form's exact mean, and a variance short of the exact one
    (scipy adaptive quadrature) by the Hermite remainder e2^2 v^2/2 + e3^2 v^3/6 + O(v^4),
    never above it; within 1e-3 absolute for v <= 0.05 (float64)."""
    m = np.linspace(-6, 6, 41)
    s = math.sqrt(v)
    exact_mean = np.array([_quad(_gelu, mi, s) for mi in m])
    exact_var = np.array(
        [
            _quad(lambda x, c=c: (_gelu(x) - c) ** 2, mi, s)
            for mi, c in zip(m, exact_mean, strict=True)
        ]
    )
    mean_t = torch.tensor(m, dtype=torch.float64)
    mean, var = S.gelu_slope_diag(mean_t, torch.full_like(mean_t, v))
    np.testing.assert_allclose(mean.numpy(), exact_mean, rtol=1e-9, atol=1e-14)
    gap = exact_var - var.numpy()
    t = 1 + v
    h, mu, vp = m / math.sqrt(t), m / t, v / t
    pdf_r = np.exp(-0.5 * h * h) / np.sqrt(2 * np.pi * t)
    e2, e3 = pdf_r * (2 - mu * mu - vp), pdf_r * mu * (mu * mu + 3 * vp - 4)
    remainder = e2**2 * v**2 / 2 + e3**2 * v**3 / 6
    assert gap.min() >= -1e-9 * exact_var.max()
    np.testing.assert_allclose(gap, remainder, rtol=1e-6, atol=2 * v**4 + 1e-15)
    if v <= 0.05:
        assert gap.max() < 1e-3


def test_slope_rule_full_mode_and_module():
    """Full mode: the first Mehler term, whose diagonal is the diag rule's variance (PSD);
    the module and ``set_rules`` take it; tanh GELUs refuse it."""
    torch.manual_seed(0)
    a = torch.randn(4, 4, dtype=torch.float64)
    cov = 0.05 * a @ a.T
    mean = torch.randn(4, dtype=torch.float64)
    out_mean, out_cov = S.gelu_slope_full(mean, cov)
    d_mean, d_var = S.gelu_slope_diag(mean, cov.diagonal())
    torch.testing.assert_close(out_mean, d_mean, rtol=1e-14, atol=0)
    torch.testing.assert_close(out_cov.diagonal(), d_var, rtol=1e-14, atol=0)
    assert float(torch.linalg.eigvalsh(out_cov).min()) >= -1e-15
    e1 = S.gelu_closed_slope(mean, cov.diagonal())
    torch.testing.assert_close(out_cov, e1[:, None] * cov * e1[None, :], rtol=1e-14, atol=0)
    g = GELU(rule="slope")
    x = Gaussian(mean.unsqueeze(0), var=cov.diagonal().unsqueeze(0))
    out = g(x, mode="diag")
    torch.testing.assert_close(out.var[0], d_var, rtol=0, atol=0)
    with pytest.raises(ValueError, match="exact GELU"):
        GELU("tanh", rule="slope")
    net = Sequential(BayesLinear(2, 3), GELU())
    assert posthoc.set_rules(net, gelu_rule="slope") == 1 and net[1].rule == "slope"


def test_slope_rule_network_against_weight_draws():
    """A residual GELU network at a posterior's scale (weight sd 0.1), slope rule, full mode:
    within 0.05 MC sd on the mean and 3 % on the sd of 20,000 weight draws (measured 1.4 %;
    the closed rule 0.7 %); in diag mode (whose error, 11 %, is the dropped correlations,
    the same for both rules) its sd is within 2 % of the closed rule's."""
    torch.manual_seed(0)
    layers = [
        BayesLinear(3, 8, init_scale=0.1),
        Residual(
            BayesLinear(8, 16, init_scale=0.1),
            GELU(rule="slope"),
            BayesLinear(16, 8, init_scale=0.1),
        ),
        BayesLinear(8, 2, init_scale=0.1),
    ]
    net = Sequential(*layers).double()
    x = torch.randn(5, 3, dtype=torch.float64)
    torch.manual_seed(1)
    res = compare_with_monte_carlo(net, x, mode="full", num_samples=20_000, chunk_size=5_000)
    assert res.mean_error <= 0.05 and res.std_rel_error <= 0.03, res
    with torch.no_grad():
        slope = net(x, mode="diag")
        posthoc.set_rules(net, gelu_rule="closed")
        closed = net(x, mode="diag")
    torch.testing.assert_close(slope.mean, closed.mean, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(slope.var.sqrt(), closed.var.sqrt(), rtol=0.02, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_slope_rule_in_place_path_equals_the_autograd_path(dtype):
    """``rule="slope"`` without autograd runs in place: the same values as with it."""
    torch.manual_seed(0)
    m = 3 * torch.randn(4, 5, 33, dtype=dtype)
    v = torch.rand(4, 5, 33, dtype=dtype) * torch.logspace(-6, 1, 33, dtype=dtype)
    with torch.no_grad():
        fast = S.gelu_slope_diag(m, v)
    slow = S.gelu_slope_diag(m.clone().requires_grad_(), v.clone().requires_grad_())
    # the same operations, some fused: rounding apart, relative to the terms' sizes (the
    # slope E[GELU'] cancels near m = -0.75, where its square's relative error grows)
    eps = torch.finfo(dtype).eps
    for a, b, size in zip(fast, slow, (m.abs() + v, v), strict=True):
        assert a.shape == m.shape
        err = (a - b.detach()).abs()
        assert bool((err <= 16 * eps * (b.detach().abs() + size)).all()), err.max()
