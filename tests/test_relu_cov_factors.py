"""The full ReLU covariance's executors against autograd through the textbook formula (float64).

:func:`lightning_dvi.moments._relu_cov.relu_cov` runs one formula (``moments/_relu_cov.py``) in
several ways: circulant bands of the pairs (small matrices) or row bands of the upper
triangle (the CPU's blocked executor), whole tensors (GPU, ``torch.compile``); the blocked forward keeps the
backward's factors when :func:`~lightning_dvi.moments.policy.keep_factors` allows and the
backward recomputes them otherwise. Every way must give the values and gradients of autograd
through an independent, textbook transcription of the formula, written here with ordinary torch
ops on the pairs ``j < l``: :math:`C_{jl} = \\Sigma_{jl}\\Phi_j\\Phi_l + \\sigma_j\\sigma_l
P(\\rho)e^{-Q}/2\\pi`, :math:`P = \\rho\\arcsin\\rho + \\sqrt{1-\\rho^2} - 1`, clamped to
:math:`\\pm\\sqrt{V_jV_l}`, ``var`` on the diagonal.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lightning_dvi.moments._relu_cov as relu_cov_module
from lightning_dvi.moments import policy
from lightning_dvi.moments._relu_cov import relu_cov

F64 = torch.float64


def _textbook(cov, sd, mu, cdf, var, gain: float = 1.0):
    d = cov.shape[-1]
    j, k = torch.triu_indices(d, d, 1)
    c = cov[..., j, k]
    scale = sd[..., j] * sd[..., k]
    rho = (c / scale).clamp(-1 + 1e-6, 1 - 1e-6)
    rho_bar = torch.sqrt(1 - rho**2)
    asin = torch.asin(rho)
    p = rho * asin + rho_bar - 1
    beta = rho**2 / (2 * p * (1 + rho_bar))
    gamma = (asin - rho) / p
    q = beta * (mu[..., j] ** 2 + mu[..., k] ** 2) - gamma * mu[..., j] * mu[..., k]
    pair = c * cdf[..., j] * cdf[..., k] + gain * scale * p * torch.exp(-q) / (2 * math.pi)
    bound = torch.sqrt(var[..., j] * var[..., k])
    pair = torch.maximum(torch.minimum(pair, bound), -bound)
    place = torch.zeros(j.numel(), d * d, dtype=pair.dtype)  # pair p -> entry (j_p, k_p)
    place[torch.arange(j.numel()), j * d + k] = 1
    upper = (pair @ place).unflatten(-1, (d, d))
    return torch.diag_embed(var) + upper + upper.transpose(-1, -2)


def _inputs(n: int, d: int, seed: int, tight: bool = False):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(n, d, d, generator=gen, dtype=F64)
    cov = a @ a.transpose(-1, -2) / d + 0.05 * torch.eye(d, dtype=F64)
    cov = cov + 0.3 * torch.randn(n, d, d, generator=gen, dtype=F64).tril(-1)  # never read
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    mu = torch.randn(n, d, generator=gen, dtype=F64)
    cdf = torch.special.ndtr(mu)
    if tight:  # tiny output variances: the clamp binds on most pairs
        var = 0.02 * torch.rand(n, d, generator=gen, dtype=F64) + 1e-3
    else:
        var = sd**2 * (0.3 + 0.2 * torch.rand(n, d, generator=gen, dtype=F64))
    return [t.contiguous().requires_grad_() for t in (cov, sd, mu, cdf, var)]


_WAYS = {
    # (BLOCK, kernel backend, memory budget): circulant bands / row bands, kept or not
    "circulant bands, kept": (1 << 16, "blocked", None),
    "circulant bands, recomputed": (1 << 16, "blocked", 1),
    "row bands, kept": (12, "blocked", None),
    "row bands, recomputed": (12, "blocked", 1),
    "several band blocks, kept": (60, "blocked", None),
    "several band blocks, recomputed": (60, "blocked", 1),
    "whole tensors": (1 << 16, "whole", None),
}


@pytest.mark.parametrize("tight", [False, True], ids=["free", "clamped"])
@pytest.mark.parametrize("way", list(_WAYS))
def test_every_way_matches_autograd_through_the_textbook_formula(monkeypatch, way, tight):
    block, backend, budget = _WAYS[way]
    monkeypatch.setattr(relu_cov_module, "BLOCK", block)
    n, d = (7, 6) if block == 60 else (3, 5)  # 60: two blocks of circulant bands
    inputs = _inputs(n, d, seed=1, tight=tight)
    gen = torch.Generator().manual_seed(9)
    g_out = torch.randn(n, d, d, generator=gen, dtype=F64)
    expected = _textbook(*inputs)
    expected_grads = torch.autograd.grad(expected, inputs, g_out)
    with policy.kernel_backend(backend):  # type: ignore[arg-type]
        if budget is None:
            out = relu_cov(*inputs)
        else:
            with policy.memory_budget(budget):
                out = relu_cov(*inputs)
    grads = torch.autograd.grad(out, inputs, g_out)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert torch.equal(out, out.transpose(-1, -2))
    for name, got, want in zip(
        ("cov", "sd", "mu", "cdf", "var"), grads, expected_grads, strict=True
    ):
        if name == "cov":  # only the upper triangle is read
            want = want.triu(1)
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10, msg=f"d/d{name} ({way})")


@pytest.mark.parametrize("tight", [False, True], ids=["free", "clamped"])
@pytest.mark.parametrize("d", [1, 2, 3, 4, 7, 8])
def test_circulant_bands_hold_every_pair_once_at_odd_and_even_sizes(d, tight):
    # even D: the last offset's second half repeats its first half (zero gradient weight)
    inputs = _inputs(5, d, seed=d, tight=tight)
    g_out = torch.randn(5, d, d, generator=torch.Generator().manual_seed(d), dtype=F64)
    expected = _textbook(*inputs)
    with policy.kernel_backend("blocked"):
        out = relu_cov(*inputs)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    grads = torch.autograd.grad(out, inputs, g_out)
    for got, want in zip(grads, torch.autograd.grad(expected, inputs, g_out), strict=True):
        want = want.triu(1) if got.dim() == 3 else want
        torch.testing.assert_close(got, want, rtol=1e-8, atol=1e-10)


def test_several_band_blocks_are_several():
    assert len(relu_cov_module._band_rows(7, 3 * 6, 60)) == 2
    assert len(relu_cov_module._band_rows(500, 16 * 32, 1 << 16)) == 2


@pytest.mark.parametrize("block", [1 << 16, 12])
def test_kept_factors_pass_gradcheck(monkeypatch, block):
    monkeypatch.setattr(relu_cov_module, "BLOCK", block)
    inputs = _inputs(2, 4, seed=3)
    assert torch.autograd.gradcheck(relu_cov, inputs)


class _Ops(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[func.__name__.split(".")[0]] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("budget", [None, 1])
def test_backward_recomputes_the_terms_only_when_the_factors_were_not_kept(budget):
    inputs = _inputs(4, 6, seed=5)
    g_out = torch.ones(4, 6, 6, dtype=F64)
    with policy.kernel_backend("blocked"):
        if budget is None:
            out = relu_cov(*inputs)
        else:
            with policy.memory_budget(budget):
                out = relu_cov(*inputs)
    with _Ops() as ops:
        out.backward(g_out)
    recomputed = ops.count["asin"] + ops.count["exp_"]
    assert (recomputed > 0) == (budget is not None)


def test_no_factors_are_kept_without_gradients():
    inputs = [t.detach() for t in _inputs(4, 6, seed=6)]
    with policy.kernel_backend("blocked"), _Ops() as ops:
        relu_cov(*inputs)
    with policy.kernel_backend("blocked"), _Ops() as with_grad:
        relu_cov(*[t.requires_grad_() for t in inputs])
    # the factors (dK/drho and the products) cost passes only when a backward will read them
    assert sum(ops.count.values()) < sum(with_grad.count.values())


def test_keep_factors_follows_a_quarter_of_the_memory_budget():
    with policy.memory_budget(4000):
        assert policy.keep_factors(250, torch.float32)
        assert not policy.keep_factors(251, torch.float32)
        assert not policy.keep_factors(126, torch.float64)
