"""LayerNorm's routes: the first-order form alone, the per-tensor choice, the diag Jacobian.

Oracles: torch's autograd Jacobian of ``F.layer_norm`` (the first-order form is
:math:`\\hat m + J(a - \\mu)`), the eigendecomposition route :func:`normalize_jacobian`, and
Monte Carlo in float64.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_dvi import Gaussian
from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.moments import layer_norm as L
from lightning_dvi.nn import BayesLinear, LayerNorm, ReLU, Residual, Sequential, posthoc

F64 = torch.float64


def _inputs(rows: int, d: int, scale: float, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(rows, d, generator=gen, dtype=F64)
    var = scale * torch.rand(rows, d, generator=gen, dtype=F64)
    return mean, var


def _autograd_jacobian(mean: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    d = mean.shape[-1]
    rows = [
        torch.autograd.functional.jacobian(lambda a: nn.functional.layer_norm(a, (d,), eps=eps), m)
        for m in mean
    ]
    return torch.stack(rows)


def test_first_order_route_is_the_linearization_of_torch_layer_norm():
    mean, var = _inputs(5, 6, 0.3)
    jac = _autograd_jacobian(mean)
    got_mean, got_var = L.normalize_diag(mean, var, route="first_order")
    torch.testing.assert_close(got_mean, nn.functional.layer_norm(mean, (6,), eps=1e-5))
    want_var = torch.einsum("bij,bj,bij->bi", jac, var, jac)
    torch.testing.assert_close(got_var, want_var)
    slope = L.normalize_diag_with_slope(mean, var, route="first_order")[2]
    torch.testing.assert_close(slope, jac.diagonal(0, -2, -1))
    cross = torch.randn(5, 3, 6, dtype=F64)
    torch.testing.assert_close(
        L.normalize_cross_diag(cross, mean, var, route="first_order"), cross @ jac.mT
    )
    cov = torch.diag_embed(var)
    full_mean, full_cov = L.normalize_full(mean, cov, route="first_order")
    torch.testing.assert_close(full_mean, got_mean)
    torch.testing.assert_close(full_cov, jac @ cov @ jac.mT)
    torch.testing.assert_close(L.normalize_jacobian(mean, cov, route="first_order"), jac)


@pytest.mark.parametrize("d", [2, 4, 16])
def test_diag_cross_covariance_without_eigh_equals_the_eigendecomposition_route(d):
    mean, var = _inputs(6, d, 0.5, seed=d)
    cross = torch.randn(6, 3, d, dtype=F64)
    want = cross @ L.normalize_jacobian(mean, torch.diag_embed(var)).mT
    got = L.normalize_cross_diag(cross, mean, var)
    # normalize_jacobian separates equal eigenvalues by a 1e-7 relative jitter
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_diag_cross_covariance_against_monte_carlo():
    """Cov(a, y) = diag(v) E[grad y]^T (Stein), 200,000 float64 draws."""
    mean, var = _inputs(3, 5, 1.0, seed=3)
    gen = torch.Generator().manual_seed(1)
    draws = mean + var.sqrt() * torch.randn(200_000, 3, 5, generator=gen, dtype=F64)
    y = nn.functional.layer_norm(draws, (5,), eps=1e-5)
    mc = torch.einsum("sbi,sbj->bij", draws - draws.mean(0), y - y.mean(0)) / (len(draws) - 1)
    got = L.normalize_cross_diag(torch.diag_embed(var), mean, var)
    torch.testing.assert_close(got, mc, rtol=0, atol=0.01)
    first = L.normalize_cross_diag(torch.diag_embed(var), mean, var, route="first_order")
    assert (first - mc).abs().max() > 0.02  # at this variance the first-order form is off


def test_first_order_route_against_exact_and_monte_carlo_at_small_variance():
    """Where the variance is small against the spread (rho ~ 1e-3) both routes agree with MC."""
    mean, var = _inputs(4, 32, 2e-3, seed=5)
    exact = L.normalize_diag(mean, var)
    first = L.normalize_diag(mean, var, route="first_order")
    gen = torch.Generator().manual_seed(2)
    draws = mean + var.sqrt() * torch.randn(100_000, 4, 32, generator=gen, dtype=F64)
    y = nn.functional.layer_norm(draws, (32,), eps=1e-5)
    torch.testing.assert_close(first[0], y.mean(0), rtol=0, atol=2e-3)
    torch.testing.assert_close(first[1], y.var(0), rtol=0.03, atol=1e-7)
    torch.testing.assert_close(first[1], exact[1], rtol=0.01, atol=1e-8)
    torch.testing.assert_close(first[0], exact[0], rtol=0, atol=2e-3)


def test_auto_route_computes_only_the_route_a_tensor_needs(monkeypatch):
    calls: list[str] = []
    exact, first = L._exact_diag, L._first_order_diag

    def spy(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return call

    monkeypatch.setattr(L, "_exact_diag", spy("exact", exact))
    monkeypatch.setattr(L, "_first_order_diag", spy("first", first))
    mean, var = _inputs(4, 8, 1.0)
    L.normalize_diag(mean, var)
    assert calls == ["exact"]
    calls.clear()
    L.normalize_diag(mean, var * 1e-12)  # rho < TIGHT_RATIO everywhere
    assert calls == ["first"]
    calls.clear()
    L.normalize_diag(mean, var, route="first_order")
    assert calls == ["first"]
    calls.clear()
    mixed = var * torch.tensor([1.0, 1e-12, 1.0, 1e-12], dtype=F64)[:, None]
    L.normalize_diag(mean, mixed)
    assert sorted(calls) == ["exact", "first"]


def test_auto_route_on_a_mixed_tensor_equals_each_vector_alone_and_the_traced_form(monkeypatch):
    mean, var = _inputs(4, 8, 1.0)
    mixed = var * torch.tensor([1.0, 1e-12, 1.0, 1e-12], dtype=F64)[:, None]
    got = L.normalize_diag_with_slope(mean, mixed)
    for i in range(4):
        alone = L.normalize_diag_with_slope(mean[i : i + 1], mixed[i : i + 1])
        for g, a in zip(got, alone, strict=True):
            torch.testing.assert_close(g[i : i + 1], a)
    cross = torch.randn(4, 2, 8, dtype=F64)
    got_cross = L.normalize_cross_diag(cross, mean, mixed)
    monkeypatch.setattr(L, "_traced", lambda: True)  # both routes, then torch.where
    traced = L.normalize_diag_with_slope(mean, mixed)
    for g, t in zip(got, traced, strict=True):
        torch.testing.assert_close(g, t)
    torch.testing.assert_close(L.normalize_cross_diag(cross, mean, mixed), got_cross)


@pytest.mark.parametrize("route", ["auto", "first_order"])
def test_gradients_of_the_routes(route):
    mean, var = _inputs(3, 4, 0.5)
    # auto: a mixed tensor; the tight row (rho ~ 1e-7) stays tight under gradcheck's steps
    mean = mean * torch.tensor([1.0, 10.0, 1.0], dtype=F64)[:, None]
    var = var * torch.tensor([1.0, 1e-5, 1.0], dtype=F64)[:, None] + 2e-6
    assert L._is_tight(mean, var, 1e-5).tolist() == [False, True, False]
    mean.requires_grad_(True)
    var.requires_grad_(True)
    cross = torch.randn(3, 2, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda m, v: L.normalize_diag(m, v, route=route), (mean, var))
    assert torch.autograd.gradcheck(
        lambda c, m, v: L.normalize_cross_diag(c, m, v, route=route), (cross, mean, var)
    )


def test_first_order_layer_norm_in_a_residual_block_against_monte_carlo():
    torch.manual_seed(0)
    net = Sequential(
        BayesLinear(3, 8, init_scale=0.05),
        Residual(LayerNorm(8, route="first_order"), ReLU(), BayesLinear(8, 8, init_scale=0.05)),
        BayesLinear(8, 2, init_scale=0.05),
    ).double()
    x = torch.randn(4, 3, dtype=F64)
    res = compare_with_monte_carlo(net, x, mode="diag", num_samples=20_000)
    assert res.mean_error < 0.1 and res.std_rel_error < 0.3, res
    assert "route='first_order'" in repr(net)


def test_routes_and_rules_are_checked_and_set():
    with pytest.raises(ValueError, match="route must be one of"):
        LayerNorm(4, route="fast")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="route must be one of"):
        L.normalize_diag(torch.zeros(1, 4), torch.ones(1, 4), route="fast")  # type: ignore[arg-type]
    net = nn.Sequential(nn.Linear(4, 4), nn.TransformerEncoderLayer(4, 2, 8, batch_first=True))
    converted = posthoc.from_torch_posterior(
        net, 0.01, attention_rule="mean", layer_norm_route="first_order"
    )
    layer = converted[1]
    assert layer.self_attn.rule == "mean" and layer.options["rule"] == "mean"
    assert layer.norm1.route == layer.norm2.route == "first_order"
    assert posthoc.set_rules(converted, attention_rule="unscented") == 1
    assert layer.self_attn.rule == "unscented" and layer.norm1.route == "first_order"
    with pytest.raises(ValueError, match="attention_rule must be one of"):
        posthoc.set_rules(converted, attention_rule="none")  # type: ignore[arg-type]
    x = torch.randn(2, 3, 4)
    out = converted(x, mode="diag")
    assert isinstance(out, Gaussian) and bool((out.var > 0).all())
