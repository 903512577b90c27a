"""Categorical(method="tight") (issue 41 item 1): a certified lower bound, and a tight one.

Oracles: Monte Carlo with its standard error (random cases, float64), ``scipy.integrate.quad``
for K = 2 (a one-dimensional integral) and a tensor Gauss–Hermite rule for K = 3 (two
dimensions). Documented numbers: docs/likelihoods_and_priors.md ("A tighter bound").
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from helpers import log_softmax_draws, logit_grid
from scipy import integrate

from lightning_dvi import Gaussian
from lightning_dvi.likelihoods import Categorical, logistic_normal
from lightning_dvi.likelihoods import functional as F
from lightning_dvi.moments import special
from lightning_dvi.moments.special import tail_cutoff

F64 = torch.float64
tight = F.categorical_tight_expected_log_prob


def _all_labels(mean: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, ...]:
    k = mean.shape[-1]
    return mean.expand(k, k), cov.expand(k, *cov.shape), torch.arange(k)


@pytest.fixture(scope="module")
def monte_carlo():
    gen = torch.Generator().manual_seed(41)
    rows = []
    for k, v, mean, cov, full in logit_grid(41, (0.1, 1.0, 10.0, 100.0), (0.0, 3.0)):
        log_sm = log_softmax_draws(mean, full, 20_000, gen)
        rows.append((k, v, mean, cov, log_sm.mean(0), log_sm.std(0) / 20_000**0.5))
    return rows


def test_tight_bound_never_above_monte_carlo_and_halves_the_gap(monte_carlo) -> None:
    gaps: dict[str, dict[float, list[float]]] = {"tight": {}, "bound": {}}
    for k, v, mean, cov, mc, se in monte_carlo:
        if k == 2:  # one-vs-each is exact there: checked against quadrature below instead
            continue
        means, covs, labels = _all_labels(mean, cov)
        got = tight(means, covs, labels)
        assert ((got - mc) / se).max() < 3, (k, v)  # never above Monte Carlo beyond 3 SE
        old = F.categorical_bound_expected_log_prob(means, covs, labels)
        gaps["tight"].setdefault(v, []).extend((mc - got).tolist())
        gaps["bound"].setdefault(v, []).extend((mc - old).tolist())
    mean_gap = {name: {v: float(np.mean(g)) for v, g in d.items()} for name, d in gaps.items()}
    assert mean_gap["tight"][0.1] <= 0.01
    for v in (1.0, 10.0, 100.0):  # the acceptance target: at most half of the earlier gap
        assert mean_gap["tight"][v] <= 0.5 * mean_gap["bound"][v], (v, mean_gap)


def _quad_two_classes(mu: float, s2: float) -> float:
    """``E log sigmoid(-d)``, ``d ~ N(mu, s2)`` (= E log softmax(a)_y for K = 2)."""
    s = math.sqrt(s2)
    dens = lambda x: math.exp(-0.5 * ((x - mu) / s) ** 2) / (s * math.sqrt(2 * math.pi))  # noqa: E731
    f = lambda x: -(max(x, 0.0) + math.log1p(math.exp(-abs(x)))) * dens(x)  # noqa: E731
    pts = [mu - 40 * s, min(max(0.0, mu - 40 * s), mu + 40 * s), mu + 40 * s]
    pts = sorted({*pts, mu})
    return sum(
        integrate.quad(f, a, b, epsabs=1e-13, epsrel=1e-12, limit=400)[0]
        for a, b in itertools.pairwise(pts)
    )


def test_two_classes_against_quadrature() -> None:
    gen = torch.Generator().manual_seed(2)
    mean = 4 * torch.randn(40, 2, generator=gen, dtype=F64)
    var = torch.logspace(-3, 3, 40, dtype=F64)[:, None] * torch.rand(
        40, 2, generator=gen, dtype=F64
    )
    y = torch.randint(2, (40,), generator=gen)
    got = tight(mean, var, y)
    d_mean = (mean.gather(-1, 1 - y[:, None]) - mean.gather(-1, y[:, None]))[:, 0]
    exact = torch.tensor(
        [_quad_two_classes(float(m), float(s)) for m, s in zip(d_mean, var.sum(-1), strict=True)],
        dtype=F64,
    )
    assert (got <= exact + 1e-12 * (1 + exact.abs())).all()  # a bound
    assert ((exact - got) / exact.abs()).max() < 4e-4  # one-vs-each: exact to the series


def test_two_classes_full_cov_value_and_gradient_against_quadrature() -> None:
    # K = 2: E log softmax(a)_y = E log sigmoid(d), d = a_y - a_k ~ N(mu_y - mu_k, V),
    # V = C_yy + C_kk - 2 C_yk, a 1-D integral; value and gradient against quadrature
    gen = torch.Generator().manual_seed(21)
    n = 24
    mean = 4 * torch.randn(n, 2, generator=gen, dtype=F64)
    a = torch.randn(n, 2, 2, generator=gen, dtype=F64)
    cov = a @ a.mT * torch.logspace(-2, 2, n, dtype=F64)[:, None, None]
    y = torch.randint(2, (n,), generator=gen)
    m, c = mean.clone().requires_grad_(), cov.clone().requires_grad_()
    got = tight(m, c, y)
    sign = 1 - 2 * y.to(F64)  # d = sign * (a_0 - a_1)
    d_mean = sign * (mean[:, 0] - mean[:, 1])
    d_var = cov[:, 0, 0] + cov[:, 1, 1] - 2 * cov[:, 0, 1]
    ones = torch.ones(n, dtype=F64)  # the Bernoulli bound on d (one-vs-each): never above it
    assert (got.detach() >= F.bernoulli_expected_log_prob(d_mean, d_var, ones) - 1e-13).all()
    exact = torch.tensor(
        [_quad_two_classes(-float(mu), float(v)) for mu, v in zip(d_mean, d_var, strict=True)],
        dtype=F64,
    )
    assert (got.detach() <= exact + 1e-12 * (1 + exact.abs())).all()  # a bound
    assert ((exact - got.detach()) / exact.abs()).max() < 4e-4
    # gradient: dE/dmu_d = E sigmoid(-d), dE/dV = -E[sigmoid(d) sigmoid(-d)] / 2 (Stein)
    gm, gc = torch.autograd.grad(got.sum(), (m, c))
    # a fine trapezoid rule over +-40 sd (Gauss-Hermite misses the bend at d = 0 for large V)
    z = torch.linspace(-40, 40, 200_001, dtype=F64)
    w = torch.exp(-0.5 * z * z) * (z[1] - z[0]) / math.sqrt(2 * math.pi)
    d = d_mean[:, None] + d_var.sqrt()[:, None] * z
    dmu = (torch.sigmoid(-d) * w).sum(-1)
    dv = -0.5 * (torch.sigmoid(d) * torch.sigmoid(-d) * w).sum(-1)
    torch.testing.assert_close(sign * (gm[:, 0] - gm[:, 1]) / 2, dmu, rtol=2e-3, atol=1e-9)
    torch.testing.assert_close(gm.sum(-1), torch.zeros(n, dtype=F64), rtol=0, atol=1e-12)
    # the covariance enters through V only: dV/dC = (1, -1; -1, 1), C_01 and C_10 together.
    # Where the second-order Jensen term is the larger bound (small V) its V-derivative is the
    # expansion's: measured within 2.5 % of the true one on a grid of means and variances
    torch.testing.assert_close(gc[:, 0, 1] + gc[:, 1, 0], -(gc[:, 0, 0] + gc[:, 1, 1]))
    torch.testing.assert_close(gc[:, 0, 0], dv, rtol=3e-2, atol=1e-6)
    torch.testing.assert_close(gc[:, 1, 1], dv, rtol=3e-2, atol=1e-6)


def test_three_classes_against_gauss_hermite() -> None:
    # E log softmax(a)_y = -E log(1 + e^{d_1} + e^{d_2}), d = a_k - a_y: a 2-d Gaussian integral
    nodes, weights = np.polynomial.hermite_e.hermegauss(80)
    z1, z2 = np.meshgrid(nodes, nodes, indexing="ij")
    w = np.outer(weights, weights) / (2 * np.pi)
    gen = torch.Generator().manual_seed(3)
    for v in (0.05, 0.5, 2.0, 8.0):
        for _ in range(6):
            mean = 2 * torch.randn(3, generator=gen, dtype=F64)
            a = torch.randn(3, 3, generator=gen, dtype=F64)
            cov = a @ a.T
            cov = v * cov / cov.diagonal().mean()
            y = int(torch.randint(3, (1,), generator=gen))
            o = [k for k in range(3) if k != y]
            proj = torch.zeros(2, 3, dtype=F64)
            proj[0, o[0]] = proj[1, o[1]] = 1
            proj[:, y] = -1
            dm, dc = (proj @ mean).numpy(), (proj @ cov @ proj.T).numpy()
            chol = np.linalg.cholesky(dc + 1e-14 * np.eye(2))
            d1 = dm[0] + chol[0, 0] * z1
            d2 = dm[1] + chol[1, 0] * z1 + chol[1, 1] * z2
            top = np.maximum(0, np.maximum(d1, d2))
            lse = top + np.log(np.exp(-top) + np.exp(d1 - top) + np.exp(d2 - top))
            exact = -(w * lse).sum()
            got = float(tight(mean, cov, torch.tensor(y)))
            assert got <= exact + 1e-9, (v, got, exact)  # never above the integral
            assert exact - got < (0.01 if v <= 0.5 else 1.0), (v, got, exact)  # and close


def test_exact_at_zero_variance_diag_equals_full_and_policies_agree(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(4)
    mean = 3 * torch.randn(64, 5, generator=gen, dtype=F64)
    y = torch.randint(5, (64,), generator=gen)
    exact = torch.log_softmax(mean, -1).gather(-1, y[:, None])[:, 0]
    torch.testing.assert_close(tight(mean, torch.zeros_like(mean), y), exact, rtol=0, atol=1e-12)
    var = (
        torch.rand(64, 5, generator=gen, dtype=F64) * torch.logspace(-3, 2, 64, dtype=F64)[:, None]
    )
    on_subset = tight(mean, var, y)
    torch.testing.assert_close(on_subset, tight(mean, torch.diag_embed(var), y))
    # the whole-tensor policy (other devices, torch.compile) gives the same numbers
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    torch.testing.assert_close(tight(mean, var, y), on_subset, rtol=0, atol=1e-15)


def test_gradient_is_the_derivative_of_the_value() -> None:
    # the Bouchard shift c carries its implicit gradient: finite differences agree
    gen = torch.Generator().manual_seed(5)
    for v in (0.01, 1.0, 10.0, 100.0):
        mean = 2 * torch.randn(8, 6, generator=gen, dtype=F64)
        var = v * (0.2 + 1.6 * torch.rand(8, 6, generator=gen, dtype=F64))
        y = torch.randint(6, (8,), generator=gen)
        m, s = mean.clone().requires_grad_(), var.clone().requires_grad_()
        gm, gs = torch.autograd.grad(tight(m, s, y).sum(), (m, s))
        dm = torch.randn(8, 6, generator=gen, dtype=F64)
        ds = 0.1 * var * torch.randn(8, 6, generator=gen, dtype=F64)
        eps = 1e-6
        fd = (
            tight(mean + eps * dm, var + eps * ds, y) - tight(mean - eps * dm, var - eps * ds, y)
        ) / (2 * eps)
        torch.testing.assert_close((gm * dm).sum(-1) + (gs * ds).sum(-1), fd, rtol=1e-5, atol=1e-6)


def test_bouchard_shift_converges_to_its_root() -> None:
    gen = torch.Generator().manual_seed(6)
    scale = torch.logspace(-1, 3, 200, dtype=F64)[:, None]
    mean = torch.randn(200, 10, generator=gen, dtype=F64) * scale.sqrt() * 3
    var = torch.rand(200, 10, generator=gen, dtype=F64) * scale
    c = logistic_normal._bouchard_shift(mean, var)
    kappa = torch.rsqrt(1 + logistic_normal._PROBIT * var)
    h = torch.logsumexp(torch.nn.functional.logsigmoid((mean - c) * kappa), -1)
    assert h.abs().max() < 1e-9


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_values_and_gradients_finite_at_extremes(dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    scale = torch.logspace(-2, 4, 40, dtype=F64)[:, None]
    mean = (torch.randn(40, 10, generator=gen, dtype=F64) * scale).to(dtype).requires_grad_()
    y = torch.randint(10, (40,), generator=gen)
    for v in (0.0, 1e-12, 1e-3, 1.0, 1e2, 1e3):
        var = torch.full((40, 10), v, dtype=dtype, requires_grad=True)
        ll = tight(mean, var, y)
        g_mean, g_var = torch.autograd.grad(ll.sum(), (mean, var))
        for t in (ll, g_mean, g_var):
            assert torch.isfinite(t).all(), v
    # a dominant class far ahead: the shift's slope underflows in float32, its gradient does not
    mean = torch.tensor([[100.0, -100.0, -100.0]], dtype=dtype, requires_grad=True)
    var = torch.full((1, 3), 2.0, dtype=dtype, requires_grad=True)
    g = torch.autograd.grad(tight(mean, var, torch.tensor([1])).sum(), (mean, var))
    assert all(torch.isfinite(t).all() for t in g)


def test_categorical_method_tight_and_errors() -> None:
    out_mean = torch.randn(4, 3, dtype=F64)
    var = torch.rand(4, 3, dtype=F64) * 5
    y = torch.tensor([0, 1, 2, 0])
    lik = Categorical(3, method="tight")
    torch.testing.assert_close(
        lik.expected_log_prob(Gaussian(out_mean, var=var), y), tight(out_mean, var, y)
    )
    with pytest.raises(ValueError, match="tight"):
        Categorical(3, method="tighter")
    with pytest.raises(ValueError, match="fits neither"):
        tight(out_mean, torch.ones(4, 2), y)


def _frozen_bouchard_shift(mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """The shift as computed before the early stop (16 safeguarded Newton steps, always)."""
    with torch.no_grad():
        kappa = torch.rsqrt(1 + logistic_normal._PROBIT * var)
        hi = (mean + math.log(mean.shape[-1]) / kappa).amax(-1, keepdim=True)
        lo = mean.topk(2, dim=-1).values[..., 1:]
        c = hi
        for _ in range(16):
            z = (mean - c) * kappa
            log_sig = torch.nn.functional.logsigmoid(z)
            h = torch.logsumexp(log_sig, -1, keepdim=True)
            slope = -(torch.softmax(log_sig, -1) * kappa * torch.sigmoid(-z)).sum(-1, keepdim=True)
            hi = torch.where(h <= 0, c, hi)
            lo = torch.where(h > 0, c, lo)
            step = c - h / slope.clamp_max(-torch.finfo(mean.dtype).tiny)
            c = torch.where((step >= lo) & (step <= hi), step, 0.5 * (lo + hi))
        z = (mean - c) * kappa
        weight = torch.softmax(
            kappa.log() + torch.nn.functional.logsigmoid(z) + torch.nn.functional.logsigmoid(-z),
            -1,
        )
        var_coef = (-0.5 * logistic_normal._PROBIT) * kappa.square() * (mean - c)
    moved = (mean - mean.detach()) + var_coef * (var - var.detach())
    return c + (weight * moved).sum(-1, keepdim=True)


def _digits_like(seed: int, rows: int = 256) -> tuple[torch.Tensor, ...]:
    """Logits like the digits classifier's head in training: K = 10, variances 1 to 70, full."""
    gen = torch.Generator().manual_seed(seed)
    mean = 3 * torch.randn(rows, 10, generator=gen, dtype=F64)
    scale = torch.logspace(0, math.log10(70), rows, dtype=F64)[:, None, None]
    root = torch.randn(rows, 10, 10, generator=gen, dtype=F64) * (scale / 10).sqrt()
    return mean, root @ root.mT, torch.randint(10, (rows,), generator=gen)


def _value_and_grads(mean, cov, y) -> tuple[torch.Tensor, ...]:
    m, c = mean.clone().requires_grad_(), cov.clone().requires_grad_()
    value = tight(m, c, y)
    return (value, *torch.autograd.grad(value.sum(), (m, c)))


def test_early_stopped_shift_equals_the_fixed_count(monkeypatch) -> None:
    """The early stop of the shift's Newton steps changes values and gradients by round-off only."""
    from lightning_dvi_benchmarks import softmax_grid as G

    cases = list(G.objective_grid(torch.Generator().manual_seed(0), rows=64).values())
    cases += [_digits_like(seed) for seed in (1, 2)]
    mean, cov, y = _digits_like(3)
    cases.append((mean, cov.diagonal(dim1=-2, dim2=-1).contiguous(), y))
    for mean, cov, y in cases:
        with monkeypatch.context() as patch:
            patch.setattr(logistic_normal, "_bouchard_shift", _frozen_bouchard_shift)
            frozen = _value_and_grads(mean, cov, y)
        with monkeypatch.context() as patch:  # the fixed-count path (as under torch.compile)
            patch.setattr(logistic_normal, "_tracing", lambda: True)
            fixed = _value_and_grads(mean, cov, y)
        for old, traced, new in zip(frozen, fixed, _value_and_grads(mean, cov, y), strict=True):
            torch.testing.assert_close(new, old, rtol=0, atol=1e-10)
            torch.testing.assert_close(traced, old, rtol=0, atol=1e-10)
    # the shift itself, with its implicit gradient, over the documented range of scales
    gen = torch.Generator().manual_seed(6)
    scale = torch.logspace(-1, 3, 200, dtype=F64)[:, None]
    for dtype, tol in ((F64, 1e-10), (torch.float32, 1e-3)):
        mean = (torch.randn(200, 10, generator=gen, dtype=F64) * scale.sqrt() * 3).to(dtype)
        var = (torch.rand(200, 10, generator=gen, dtype=F64) * scale).to(dtype)
        got, want = [], []
        for fn, out in ((logistic_normal._bouchard_shift, got), (_frozen_bouchard_shift, want)):
            m, v = mean.clone().requires_grad_(), var.clone().requires_grad_()
            c = fn(m, v)
            out.extend((c, *torch.autograd.grad(c.sum(), (m, v))))
        for new, old in zip(got, want, strict=True):
            torch.testing.assert_close(new, old, rtol=0, atol=tol * (1 + old.abs().max().item()))


@pytest.mark.parametrize("k", [2, 10, 15, 16, 40])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_short_row_softmax_equals_torch_softmax(k, dtype) -> None:
    # the CPU policy for class counts (exp(x - logsumexp x)) and torch.softmax: same values and
    # gradients to rounding, with -inf entries and rows of very different scales
    gen = torch.Generator().manual_seed(k)
    x = (torch.randn(300, k, generator=gen, dtype=F64) * torch.logspace(-3, 3, 300)[:, None]).to(
        dtype
    )
    x[0, 0] = float("-inf")
    cotangent = torch.randn(300, k, generator=gen, dtype=F64).to(dtype)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, want = special.row_softmax(a), torch.softmax(b, -1)
    (ga,) = torch.autograd.grad((got * cotangent).sum(), a)
    (gb,) = torch.autograd.grad((want * cotangent).sum(), b)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    torch.testing.assert_close(ga, gb, rtol=tol, atol=tol * cotangent.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_fast_path_logsumexp_and_flushed_exp_against_torch(dtype) -> None:
    # the CPU forms that keep exp off its underflow path: logsumexp equal to torch.logsumexp to
    # rounding, values and gradients, at unit and wide logit scales; exp equal where normal,
    # zero (never subnormal) below a few tiny
    gen = torch.Generator().manual_seed(9)
    for scale in (1.0, 30.0, 300.0):
        x = (scale * torch.randn(500, 6, 10, generator=gen, dtype=F64)).to(dtype)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, want = special.row_logsumexp(a), torch.logsumexp(b, -1, keepdim=True)
        (ga,) = torch.autograd.grad(got.sum(), a)
        (gb,) = torch.autograd.grad(want.sum(), b)
        tol = 4 * torch.finfo(dtype).eps
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
        # torch's gradient is exp(x - lse): the rounding of lse, eps * scale, is in it
        torch.testing.assert_close(ga, gb, rtol=tol * scale, atol=tol * scale)
    tiny = torch.finfo(dtype).tiny
    low = math.log(tail_cutoff(dtype))  # the moment core's flush
    x = [-math.inf, -1e4, math.log(tiny) - 1, low - 1, low - 0.01, low + 0.01, -5.0, 0.0, 3.0]
    x = torch.tensor(x, dtype=dtype)
    e = special.flushed_exp(x)
    assert e[:5].eq(0).all()
    torch.testing.assert_close(e[5:], x[5:].exp(), rtol=4 * torch.finfo(dtype).eps, atol=0)
    assert not ((e != 0) & (e.abs() < tiny)).any()
    assert special.flushed_exp(torch.tensor([math.nan], dtype=dtype)).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_no_subnormal_values_or_gradients_on_a_confident_head(dtype) -> None:
    # logits tens to hundreds of nats apart, as a trained head's (DESIGN: no subnormal floats):
    # neither the objective nor its gradients, for both bounds and the Bernoulli one
    mean, cov, y = _digits_like(11, rows=512)
    mean, cov = (30 * mean).to(dtype), cov.to(dtype)
    tiny = torch.finfo(dtype).tiny
    for diag in (False, True):
        c = cov.diagonal(dim1=-2, dim2=-1).contiguous() if diag else cov
        for fn in (tight, F.categorical_bound_expected_log_prob):
            m, cc = mean.clone().requires_grad_(), c.clone().requires_grad_()
            value = fn(m, cc, y)
            grads = torch.autograd.grad(value.sum(), (m, cc))
            for t in (value, *grads):
                assert torch.isfinite(t).all()
                assert not ((t != 0) & (t.abs() < tiny)).any(), (fn.__name__, diag)
    m = mean[:, 0].clone().requires_grad_()
    v = cov[:, 0, 0].clone().requires_grad_()
    value = F.bernoulli_expected_log_prob(m, v, (y % 2).to(dtype))
    for t in (value, *torch.autograd.grad(value.sum(), (m, v))):
        assert not ((t != 0) & (t.abs() < tiny)).any()
