"""Attention moments (every rule) against torch at zero variance and Monte Carlo; Embedding,
RMSNorm, positional encodings and token pooling."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from lightning_dvi import Gaussian
from lightning_dvi.moments import attention as A
from lightning_dvi.moments import rms_norm as R
from lightning_dvi.nn import (
    Embedding,
    MeanTokens,
    MultiheadAttention,
    PositionalEncoding,
    RMSNorm,
    from_torch,
    key_padding,
)
from lightning_dvi.nn.attention import DEFAULT_ATTENTION_RULE
from lightning_dvi_benchmarks.attention import attention_cell

F64 = torch.float64


def _torch_projections(mha: nn.MultiheadAttention) -> list[A.ProjectionMoments]:
    w, b = mha.in_proj_weight.detach(), mha.in_proj_bias.detach()
    e = mha.embed_dim
    parts = [
        A.ProjectionMoments(w[i * e : (i + 1) * e], None, b[i * e : (i + 1) * e], None)
        for i in range(3)
    ]
    out = mha.out_proj
    return [*parts, A.ProjectionMoments(out.weight.detach(), None, out.bias.detach(), None)]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("rule", A.ATTENTION_RULES)
@pytest.mark.parametrize("storage", ["tensor", "diag", "full"])
def test_zero_variance_is_torch_attention_with_masks(rule, storage, dtype, tol):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True).to(dtype)
    x = torch.randn(3, 5, 8, dtype=dtype)
    padding = torch.zeros(3, 5, dtype=torch.bool)
    padding[1, -2:] = True
    causal = torch.ones(5, 5, dtype=torch.bool).triu(1)
    with torch.no_grad():
        want = mha(x, x, x, attn_mask=causal, key_padding_mask=padding, need_weights=False)[0]
    second = {
        "tensor": None,
        "diag": torch.zeros_like(x),
        "full": torch.zeros(3, 5, 8, 8, dtype=dtype),
    }[storage]
    mean, var = A.self_attention_moments(
        x, second, *_torch_projections(mha), heads=2, rule=rule, causal=True,
        key_padding_mask=padding,
    )  # fmt: skip
    assert ((mean - want).abs().max() / want.abs().max()).item() < tol
    assert var.abs().max().item() <= 1e-20


def test_padded_keys_do_not_reach_the_other_tokens():
    torch.manual_seed(0)
    layer = MultiheadAttention(4, 2, init_scale=0.1).double()
    x = torch.randn(2, 4, 4, dtype=F64)
    var = torch.full_like(x, 0.1)
    padding = torch.tensor([[False, False, False, True]] * 2)
    changed_x, changed_var = x.clone(), var.clone()
    changed_x[:, -1] += 3.0
    changed_var[:, -1] *= 5
    for mode in ("diag", "full"):
        with key_padding(padding):
            a = layer(Gaussian(x, var=var), mode=mode)
            b = layer(Gaussian(changed_x, var=changed_var), mode=mode)
        torch.testing.assert_close(a.mean[:, :3], b.mean[:, :3])
        torch.testing.assert_close(a.var[:, :3], b.var[:, :3])


def test_rules_against_monte_carlo_over_weights_and_inputs():
    """One cell of the docs table at 8,000 draws (MC standard error 0.011 in the mean, 0.8 %
    in the std): the default carries the weights' uncertainty and beats SUQ's rule, which
    under-states the spread by ignoring it (the test can fail either way)."""
    cells = {c.rule: c for c in attention_cell(0.05, 0.01, draws=8_000, seeds=1)}
    default = cells[DEFAULT_ATTENTION_RULE]
    assert default.mean_error < 0.05 and default.std_error < 0.06, default
    assert default.max_std_error < 0.3, default
    assert cells["mean"].std_error > 2 * default.std_error, cells["mean"]


def test_full_storage_against_monte_carlo():
    torch.manual_seed(0)
    d, t = 6, 5
    proj = [
        A.ProjectionMoments(
            torch.randn(d, d, dtype=F64) / math.sqrt(d),
            torch.full((d, d), 0.1**2, dtype=F64),
            0.1 * torch.randn(d, dtype=F64),
            torch.full((d,), 0.1**2, dtype=F64),
        )
        for _ in range(4)
    ]
    mean = torch.randn(2, t, d, dtype=F64)
    a = torch.randn(2, t, d, d, dtype=F64)
    cov = 0.05 * a @ a.mT / d
    s = 20_000
    x = mean + (torch.linalg.cholesky(cov) @ torch.randn(s, 2, t, d, 1, dtype=F64)).squeeze(-1)
    draws = [
        (p.w_loc + p.w_var.sqrt() * torch.randn(s, d, d, dtype=F64), p.b_loc + p.b_var.sqrt() * torch.randn(s, d, dtype=F64))
        for p in proj
    ]  # fmt: skip
    y = A.attention_sample(x, *draws, heads=2, causal=True)
    mc_mean, mc_cov = y.mean(0), torch.einsum("sbti,sbtj->btij", y - y.mean(0), y - y.mean(0)) / s
    mc_std = mc_cov.diagonal(0, -2, -1).sqrt()
    out_mean, out_cov = A.self_attention_moments(mean, cov, *proj, heads=2, causal=True)
    assert ((out_mean - mc_mean).abs() / mc_std).mean() < 0.05
    std = out_cov.diagonal(0, -2, -1).sqrt()
    assert (std / mc_std - 1).abs().mean() < 0.06
    corr = out_cov / (std.unsqueeze(-1) * std.unsqueeze(-2))
    mc_corr = mc_cov / (mc_std.unsqueeze(-1) * mc_std.unsqueeze(-2))
    assert (corr - mc_corr).abs().mean() < 0.05


@pytest.mark.parametrize("mode", ["full", "diag"])
def test_gradients_are_finite_for_deterministic_and_random_tokens(mode):
    torch.manual_seed(0)
    layer = MultiheadAttention(4, 2, causal=True).double()
    x = torch.randn(2, 3, 4, dtype=F64)
    for inp in (x, Gaussian(x, var=torch.full_like(x, 0.1))):
        layer.zero_grad()
        out = layer(inp, mode=mode)
        (out.mean.sum() + out.var.sum()).backward()
        for name, p in layer.named_parameters():
            assert p.grad is not None and torch.isfinite(p.grad).all(), name
            if name.startswith("k_proj.bias"):  # shifts a row of scores: softmax ignores it
                assert p.grad.abs().max() < 1e-10, (name, p.grad)


def test_sampling_modes_draw_whole_projection_weights():
    torch.manual_seed(0)
    layer = MultiheadAttention(4, 2, init_scale=0.2).double()
    x = torch.randn(2, 3, 4, dtype=F64)
    for mode in ("sample", "local"):
        draws = layer(x, mode=mode, num_samples=4000)
        assert draws.shape == (4000, 2, 3, 4)
        ref = layer(x, mode="full")
        assert ((draws.mean(0) - ref.mean).abs() / draws.std(0)).max() < 0.2
        assert (draws.std(0) / ref.var.sqrt() - 1).abs().max() < 0.2


def test_bad_inputs_are_refused():
    with pytest.raises(ValueError, match="multiple of num_heads"):
        MultiheadAttention(5, 2)
    with pytest.raises(ValueError, match="rule must be one of"):
        MultiheadAttention(4, 2, rule="nope")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"expects \[B, T, D\]"):
        MultiheadAttention(4, 2)(torch.randn(3, 4), mode="diag")
    with pytest.raises(ValueError, match="must be bool"):
        A.attention_mask(2, 2, False, torch.zeros(1, 2), torch.device("cpu"))


def test_embedding_moments_and_draws():
    torch.manual_seed(0)
    emb = Embedding(6, 3, init_scale=0.2).double()
    ids = torch.tensor([[0, 5, 5], [2, 1, 0]])
    out = emb(ids, mode="diag")
    torch.testing.assert_close(out.mean, emb.weight_loc[ids])
    torch.testing.assert_close(out.var, emb.weight_scale[ids] ** 2)
    full = emb(ids, mode="full")
    torch.testing.assert_close(full.cov, torch.diag_embed(out.var))
    draws = emb(ids, mode="sample", num_samples=20_000)
    assert torch.equal(draws[:, 0, 1], draws[:, 0, 2])  # one table per draw
    torch.testing.assert_close(draws.mean(0), out.mean, rtol=0, atol=0.02)
    torch.testing.assert_close(draws.var(0), out.var, rtol=0.05, atol=0)
    with pytest.raises(ValueError, match="token ids must lie"):
        emb(torch.tensor([[6]]), mode="diag")
    torch_emb = nn.Embedding(6, 3).double()
    converted = from_torch(torch_emb, scale_fraction=0.0)
    torch.testing.assert_close(converted(ids, mode="diag").mean, torch_emb(ids))


@pytest.mark.parametrize("kind", ["diag", "full"])
def test_rms_norm_moments_against_monte_carlo(kind):
    gen = torch.Generator().manual_seed(0)
    d = 5
    mean = torch.randn(3, d, generator=gen, dtype=F64)
    if kind == "diag":
        cov = torch.diag_embed(
            torch.rand(3, d, generator=gen, dtype=F64)
            * torch.tensor([[0.01], [1.0], [4.0]], dtype=F64)
        )
    else:
        a = torch.randn(3, d, d, generator=gen, dtype=F64)
        cov = a @ a.mT / d
    x = mean + (
        torch.linalg.cholesky(cov) @ torch.randn(200_000, 3, d, 1, generator=gen, dtype=F64)
    ).squeeze(-1)
    y = torch.nn.functional.rms_norm(x, (d,), eps=1e-5)
    if kind == "diag":
        m, v = R.rms_normalize_diag(mean, cov.diagonal(0, -2, -1), 1e-5)
    else:
        m, c = R.rms_normalize_full(mean, cov, 1e-5)
        v = c.diagonal(0, -2, -1)
        mc = torch.einsum("sbi,sbj->bij", y - y.mean(0), y - y.mean(0)) / 200_000
        torch.testing.assert_close(c, mc, rtol=0, atol=0.01)
    assert ((m - y.mean(0)).abs() / y.std(0)).max() < 0.02
    assert (v / y.var(0) - 1).abs().max() < 0.02
    # Stein: Cov(a, y) = Sigma E[grad y]^T
    cross = torch.einsum("sbi,sbj->bij", x - x.mean(0), y - y.mean(0)) / 200_000
    jac = R.rms_normalize_jacobian(mean, cov, 1e-5)
    torch.testing.assert_close(cov @ jac.mT, cross, rtol=0, atol=0.02 * cross.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rms_norm_at_zero_variance_is_torch(dtype):
    torch.manual_seed(0)
    theirs = nn.RMSNorm(6).to(dtype)
    with torch.no_grad():
        theirs.weight.uniform_(0.5, 1.5)
    ours = from_torch(theirs, scale_fraction=0.0)[0]
    assert isinstance(ours, RMSNorm)
    x = torch.randn(4, 3, 6, dtype=dtype)
    want = theirs(x)
    tol = {"rtol": 0, "atol": 1e-12 if dtype == torch.float64 else 1e-5}
    torch.testing.assert_close(ours(x, mode="diag"), want, **tol)
    g = Gaussian(x, var=torch.zeros_like(x))
    torch.testing.assert_close(ours(g, mode="diag").mean, want, **tol)
    full = Gaussian(x, cov=torch.zeros(4, 3, 6, 6, dtype=dtype))
    torch.testing.assert_close(ours(full, mode="full").mean, want, **tol)


def test_positional_encoding_shifts_means_only_and_mean_tokens_pools():
    pe = PositionalEncoding(6, 4, learned=False).double()
    table = pe.table
    assert torch.allclose(table[1, 0], torch.sin(torch.tensor(1.0, dtype=F64)), atol=1e-6)
    assert torch.allclose(table[1, 1], torch.cos(torch.tensor(1.0, dtype=F64)), atol=1e-6)
    mean, var = torch.randn(2, 3, 4, dtype=F64), torch.rand(2, 3, 4, dtype=F64)
    out = pe(Gaussian(mean, var=var), mode="diag")
    torch.testing.assert_close(out.mean, mean + table[:3])
    torch.testing.assert_close(out.var, var)
    with pytest.raises(ValueError, match="PositionalEncoding"):
        pe(torch.zeros(1, 7, 4, dtype=F64), mode="diag")
    pooled = MeanTokens()(Gaussian(mean, var=var), mode="diag")
    torch.testing.assert_close(pooled.mean, mean.mean(1))
    torch.testing.assert_close(pooled.var, var.sum(1) / 9)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("padding", [False, True])
def test_mean_rule_diag_equals_the_diagonal_of_full_storage(causal, padding):
    """SUQ's rule in diag storage (its own lean path) against full storage's diagonal: with
    independent units the mixed tokens' covariance is diagonal within a head, so they agree
    exactly (to rounding), also with deterministic tokens."""
    gen = torch.Generator().manual_seed(0)

    def projection() -> A.ProjectionMoments:
        w = torch.randn(8, 8, generator=gen, dtype=torch.float64) / 8**0.5
        b = 0.1 * torch.randn(8, generator=gen, dtype=torch.float64)
        w_var = 0.01 * torch.rand(8, 8, generator=gen, dtype=torch.float64)
        return A.ProjectionMoments(
            w, w_var, b, 0.01 * torch.rand(8, generator=gen, dtype=torch.float64)
        )

    ps = [projection() for _ in range(4)]
    mean = torch.randn(3, 5, 8, generator=gen, dtype=torch.float64)
    var = 0.1 * torch.rand(3, 5, 8, generator=gen, dtype=torch.float64)
    mask = None
    if padding:
        mask = torch.zeros(3, 5, dtype=torch.bool)
        mask[0, 3:] = True
    kw = {"heads": 2, "rule": "mean", "causal": causal, "key_padding_mask": mask}
    for second, full in ((var, torch.diag_embed(var)), (None, torch.zeros(3, 5, 8, 8).double())):
        d_mean, d_var = A.self_attention_moments(mean, second, *ps, **kw)
        f_mean, f_cov = A.self_attention_moments(mean, full, *ps, **kw)
        torch.testing.assert_close(d_mean, f_mean, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(d_var, f_cov.diagonal(0, -2, -1), rtol=1e-10, atol=1e-14)
        assert float(d_var.min()) > 0
