"""The ``"unscented"`` attention-weight rule (the default): its softmax-of-a-Gaussian moments
against Monte Carlo, its square root's gradient, and issue 42's acceptance in the worst output
of a layer against Monte Carlo over weights and inputs."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dvi.likelihoods.functional import categorical_delta_predictive
from lightning_dvi.moments import attention as A
from lightning_dvi.nn.attention import DEFAULT_ATTENTION_RULE

F64 = torch.float64


def _softmax_draws(mean: torch.Tensor, cov: torch.Tensor, draws: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    chol = torch.linalg.cholesky(cov)
    eps = torch.randn(draws, *mean.shape, 1, generator=gen, dtype=F64)
    return torch.softmax(mean + (chol @ eps).squeeze(-1), -1)


def test_unscented_softmax_against_monte_carlo():
    """Correlated score variances 0.01-0.23: the mean within 2e-3 and on average at least twice
    as close as the second-order delta method (measured 9e-4 against 3e-3 at most); the
    covariance within 15 % of Monte Carlo's largest entry and on average at least twice as
    close as the first-order JCJ (measured 9 % against 15 % at most)."""
    torch.manual_seed(0)
    k = 5
    mean = 1.5 * torch.randn(8, k, dtype=F64)
    root = torch.randn(8, k, k, dtype=F64) * torch.rand(8, 1, 1, dtype=F64) / math.sqrt(k)
    cov = 0.3 * root @ root.mT + 0.003 * torch.eye(k, dtype=F64)
    draws = _softmax_draws(mean, cov, 200_000)
    mc_mean = draws.mean(0)
    mc_cov = torch.einsum("sbi,sbj->bij", draws - mc_mean, draws - mc_mean) / draws.shape[0]
    p, factors = A.unscented_softmax(mean, cov)
    assert factors.shape == (8, k, 2 * k)
    torch.testing.assert_close(p.sum(-1), torch.ones(8, dtype=F64))
    err = (p - mc_mean).abs().amax(-1)
    delta_err = (categorical_delta_predictive(mean, cov) - mc_mean).abs().amax(-1)
    assert err.max() < 2e-3, err
    assert err.mean() < delta_err.mean() / 2, (err, delta_err)
    scale = mc_cov.abs().amax((-1, -2))
    cov_err = (factors @ factors.mT - mc_cov).abs().amax((-1, -2)) / scale
    jac = torch.diag_embed(p) - p.unsqueeze(-1) * p.unsqueeze(-2)
    jcj_err = (jac @ cov @ jac - mc_cov).abs().amax((-1, -2)) / scale
    assert cov_err.max() < 0.15, cov_err
    assert cov_err.mean() < jcj_err.mean() / 2, (cov_err, jcj_err)


def test_unscented_softmax_is_the_softmax_at_zero_variance_and_masks_keys():
    mean = torch.randn(3, 4, dtype=F64)
    p, factors = A.unscented_softmax(mean, torch.zeros(3, 4, 4, dtype=F64))
    torch.testing.assert_close(p, torch.softmax(mean, -1), rtol=0, atol=1e-15)
    assert factors.abs().max() == 0
    # a key far below the others with no variance (a masked key) gets no weight and no spread
    cov = 0.5 * torch.eye(4, dtype=F64).expand(3, 4, 4).clone()
    cov[:, 3, :] = cov[:, :, 3] = 0
    far = mean.clone()
    far[:, 3] = mean[:, :3].amin(-1) - 60
    p, factors = A.unscented_softmax(far, cov)
    assert p[:, 3].max() < 1e-20 and factors[:, 3].abs().max() < 1e-20


def test_unscented_softmax_ignores_a_common_shift_of_the_scores():
    """Noise shared by every allowed score (a key bias's) does not move the softmax."""
    torch.manual_seed(0)
    mean = torch.randn(3, 4, dtype=F64)
    root = torch.randn(3, 4, 4, dtype=F64)
    cov = 0.2 * root @ root.mT
    allowed = torch.tensor([True, True, True, False])
    cov[..., 3, :] = cov[..., :, 3] = 0
    mean[:, 3] = mean[:, :3].amin(-1) - 60
    shift = 0.7 * allowed.to(F64)
    p, factors = A.unscented_softmax(mean, cov, allowed)
    p2, factors2 = A.unscented_softmax(mean, cov + shift[:, None] * shift[None, :], allowed)
    torch.testing.assert_close(p2, p, rtol=0, atol=1e-12)
    torch.testing.assert_close(factors2 @ factors2.mT, factors @ factors.mT, rtol=0, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
def test_principal_factor_is_a_square_root_with_the_gradient_of_the_covariance(masked):
    """``L Lᵀ = C``, and the gradient of ``L Lᵀ`` is that of ``C`` itself (finite for a
    singular ``C``); the axes are ``C``'s eigenvectors."""
    torch.manual_seed(0)
    root = torch.randn(2, 4, 3, dtype=F64)
    cov = root @ root.mT  # rank 3
    if masked:
        cov[:, 0, :] = cov[:, :, 0] = 0
    cov.requires_grad_(True)
    factor = A.principal_factor(cov)
    torch.testing.assert_close(factor @ factor.mT, cov.detach(), rtol=0, atol=1e-12)
    gram = factor.mT @ factor  # orthogonal columns: a diagonal Gram matrix
    torch.testing.assert_close(gram, torch.diag_embed(gram.diagonal(0, -2, -1)), atol=1e-12, rtol=0)
    weights = torch.randn(2, 4, 4, dtype=F64)
    weights = weights + weights.mT
    (grad,) = torch.autograd.grad((weights * (factor @ factor.mT)).sum(), cov)
    assert torch.isfinite(grad).all()
    keep = torch.ones(4, 4, dtype=torch.bool)
    if masked:  # directions with no variance have no gradient
        keep[0, :] = keep[:, 0] = False
    torch.testing.assert_close(((grad + grad.mT) / 2)[:, keep], weights[:, keep], atol=1e-6, rtol=0)


def _layer_against_monte_carlo(
    rule: str, weight_std: float, input_var: float, seed: int, draws: int = 20_000
) -> tuple[float, float]:
    """Worst output's mean error (MC std units) and std relative error of one causal layer
    (6 tokens of width 8, 2 heads; weight means N(0, 1/8), bias means N(0, 0.1²))."""
    gen = torch.Generator().manual_seed(seed)
    b, t, d, heads = 4, 6, 8, 2
    proj = []
    for _ in range(4):
        w = torch.randn(d, d, generator=gen, dtype=F64) / math.sqrt(d)
        bias = 0.1 * torch.randn(d, generator=gen, dtype=F64)
        proj.append(
            A.ProjectionMoments(
                w, torch.full_like(w, weight_std**2), bias, torch.full_like(bias, weight_std**2)
            )
        )
    mean = torch.randn(b, t, d, generator=gen, dtype=F64)
    var = torch.full_like(mean, input_var)
    total = torch.zeros_like(mean)
    outer = torch.zeros_like(mean)
    for _ in range(draws // 2_000):
        x = mean + var.sqrt() * torch.randn(2_000, *mean.shape, generator=gen, dtype=F64)
        drawn = [
            (
                p.w_loc + weight_std * torch.randn(2_000, d, d, generator=gen, dtype=F64),
                p.b_loc + weight_std * torch.randn(2_000, d, generator=gen, dtype=F64),
            )
            for p in proj
            if p.b_loc is not None
        ]
        y = A.attention_sample(x, *drawn, heads=heads, causal=True)
        total, outer = total + y.sum(0), outer + (y * y).sum(0)
    mc_mean = total / draws
    mc_std = ((outer - draws * mc_mean**2) / (draws - 1)).sqrt()
    got_mean, got_var = A.self_attention_moments(
        mean,
        var,
        *proj,
        heads=heads,
        rule=rule,
        causal=True,  # type: ignore[arg-type]
    )
    mean_err = ((got_mean - mc_mean).abs() / mc_std).max().item()
    std_err = (got_var.sqrt() / mc_std - 1).abs().max().item()
    return mean_err, std_err


@pytest.mark.parametrize(("weight_std", "input_var"), [(0.1, 0.0), (0.1, 0.01)])
def test_default_rule_meets_the_acceptance_in_the_worst_output(weight_std, input_var):
    """Issue 42: within 0.05 Monte Carlo standard deviations on the mean and 20 % on the
    standard deviation at posterior std ≤ 0.1, in **every** output (measured 0.01-0.03 and
    3-7 % here; Monte Carlo noise in the largest of 192 outputs about 0.02 and 1.5 %); the
    previous default, ``mean_field``, misses the mean (0.15 at input var 0)."""
    assert DEFAULT_ATTENTION_RULE == "unscented"
    mean_err, std_err = _layer_against_monte_carlo("unscented", weight_std, input_var, seed=1)
    assert mean_err < 0.05 and std_err < 0.2, (mean_err, std_err)
    if input_var == 0:
        old_mean_err, _ = _layer_against_monte_carlo("mean_field", weight_std, input_var, seed=1)
        assert old_mean_err > 0.05, old_mean_err


def test_rule_cost_times_every_rule():
    from lightning_dvi_benchmarks.attention import rule_cost

    for var in (0.0, 0.01):
        cost = rule_cost(2, 3, 4, 2, input_var=var, reps=1)
        assert set(cost) == set(A.ATTENTION_RULES) and min(cost.values()) >= 0, cost


@pytest.mark.parametrize("storage", ["diag", "full"])
def test_input_score_cov_against_monte_carlo(storage):
    """Deterministic weights, uncertain tokens: the scores' covariance of each row against
    Monte Carlo (the first-order correlations within a token's query and key included),
    closer than the marginal-variance form used before (measured: within 1.3 % of the row's
    largest entry, against 23-38 % on average before)."""
    torch.manual_seed(0)
    b, t, d, heads = 2, 4, 6, 2
    proj = [
        A.ProjectionMoments(torch.randn(d, d, dtype=F64) / math.sqrt(d), None, None, None)
        for _ in range(2)
    ]
    mean = torch.randn(b, t, d, dtype=F64)
    if storage == "diag":
        second = torch.full_like(mean, 0.01)
        chol = torch.diag_embed(second.sqrt())
    else:
        root = torch.randn(b, t, d, d, dtype=F64)
        second = 0.01 * root @ root.mT / d
        chol = torch.linalg.cholesky(second)
    x = mean + (chol @ torch.randn(100_000, b, t, d, 1, dtype=F64)).squeeze(-1)
    q = A.split_heads(x @ proj[0].w_loc.T, heads)
    k = A.split_heads(x @ proj[1].w_loc.T, heads)
    scores = q @ k.mT / math.sqrt(d // heads)  # [S, B, H, T, T]
    centred = scores - scores.mean(0)
    mc = torch.einsum("sbhij,sbhik->bhijk", centred, centred) / scores.shape[0]
    qh, kh = (
        A.split_heads(mean @ proj[0].w_loc.T, heads),
        A.split_heads(mean @ proj[1].w_loc.T, heads),
    )
    full = storage == "full"
    key_var = A._key_input_var(proj[1], second, full)
    model = A.input_score_cov(qh, kh, proj[0], proj[1], second, full, key_var)
    model = model + torch.diag_embed((qh * qh) @ A.split_heads(key_var, heads).mT / (d // heads))
    var = second.diagonal(0, -2, -1) if full else second
    q_var = A.split_heads(var @ (proj[0].w_loc ** 2).T, heads)
    old_shared = kh.unsqueeze(-3) * (q_var / (d // heads)).sqrt().unsqueeze(-2)
    old = torch.diag_embed((q_var + qh * qh) @ A.split_heads(key_var, heads).mT / (d // heads))
    old = old + old_shared @ old_shared.mT
    scale = mc.abs().amax((-1, -2), keepdim=True)
    err = ((model - mc).abs() / scale).amax((-1, -2))
    old_err = ((old - mc).abs() / scale).amax((-1, -2))
    assert err.max() < 0.03, err
    assert err.mean() < old_err.mean() / 10, (err.mean(), old_err.mean())
