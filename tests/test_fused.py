"""Fused moment Functions (closed-form backward) against autograd through the same formula.

:func:`lightning_dvi.moments.policy.use_fused` picks, per call, between a custom autograd
Function whose backward is written out and autograd through the formula it calls. Both must
give the same values and gradients (float64, to round-off), the Function's backward must pass
``gradcheck`` (finite differences of its forward), and a whole training step must not change.
"""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi.moments import (
    linear_deterministic,
    linear_diag,
    linear_full_from_diag,
    policy,
    relu_diag,
)
from lightning_dvi.moments.linear import _gram
from lightning_dvi.nn import mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes

F64 = torch.float64
FUSED_NODES = {
    "deterministic": "_LinearDeterministicBackward",
    "diag": "_LinearDiagBackward",
    "full_from_diag": "_LinearFullFromDiagBackward",
}


def _layer_args(kind: str, lead: tuple[int, ...], k: int, bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    d = 5
    mean = torch.randn(*lead, d, dtype=F64, generator=gen)
    var = torch.rand(*lead, d, dtype=F64, generator=gen) + 0.1
    w_loc = torch.randn(k, d, dtype=F64, generator=gen)
    w_var = torch.rand(k, d, dtype=F64, generator=gen) + 0.05
    b_loc = torch.randn(k, dtype=F64, generator=gen) if bias else None
    b_var = torch.rand(k, dtype=F64, generator=gen) + 0.05 if bias else None
    args = [t.requires_grad_() if t is not None else None for t in (w_loc, w_var, b_loc, b_var)]
    # a deterministic input is data (the fused node serves an input without gradient only)
    return [mean, *args] if kind == "deterministic" else [mean.requires_grad_(), var, *args]


_FNS = {
    "deterministic": linear_deterministic,
    "diag": linear_diag,
    "full_from_diag": linear_full_from_diag,
}
_CASES = [
    (kind, lead, bias) for kind in _FNS for lead in ((), (4,), (3, 4)) for bias in (True, False)
]


def _against_the_formula(call, wrt, node: str):
    """``call()`` through the fused node ``node`` and through the formula (the policy's switch off),
    with the gradients of both for one seeded random cotangent: ``(fused, reference, got, want)``.
    """
    fused = call()
    assert type(fused[0].grad_fn).__name__ == node  # the policy chose the Function
    with policy.fused_functions(False):
        reference = call()
    gen = torch.Generator().manual_seed(1)
    cotangents = [torch.randn(o.shape, dtype=F64, generator=gen) for o in fused]
    got = torch.autograd.grad(fused, wrt, cotangents)
    want = torch.autograd.grad(reference, wrt, cotangents)
    return fused, reference, got, want


@pytest.mark.parametrize(("kind", "lead", "bias"), _CASES)
def test_fused_values_and_gradients_match_autograd_through_the_formula(kind, lead, bias):
    fn, args = _FNS[kind], _layer_args(kind, lead, k=3, bias=bias)
    wrt = [t for t in args if t is not None and t.requires_grad]
    fused, reference, got, want = _against_the_formula(lambda: fn(*args), wrt, FUSED_NODES[kind])
    assert "Linear" not in type(reference[0].grad_fn).__name__
    for a, b in zip(fused, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("kind", "lead", "bias"), [c for c in _CASES if c[2]])
def test_fused_backward_passes_gradcheck(kind, lead, bias):
    args = _layer_args(kind, lead, k=3, bias=bias)
    assert torch.autograd.gradcheck(_FNS[kind], tuple(args))


def test_first_layer_weight_gradients_match_autograd_with_the_narrow_operand_first():
    """A wide first layer on a narrow input at a batch where ``_gram`` swaps the product order."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(600, 9, dtype=F64, generator=gen)
    w_loc, w_var = (
        torch.randn(100, 9, dtype=F64, generator=gen),
        torch.rand(100, 9, dtype=F64, generator=gen),
    )
    assert not _gram(torch.zeros(600, 100), torch.zeros(600, 9)).is_contiguous()  # swapped
    wrt = [w_loc.requires_grad_(), w_var.requires_grad_()]
    _, _, got, want = _against_the_formula(
        lambda: linear_deterministic(x, *wrt), wrt, FUSED_NODES["deterministic"]
    )
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gram_is_the_transposed_product_in_either_order():
    gen = torch.Generator().manual_seed(4)
    for rows, p, q in ((600, 100, 9), (600, 9, 100), (8, 50, 4), (600, 30, 30)):
        a, b = (torch.randn(rows, n, dtype=F64, generator=gen) for n in (p, q))
        torch.testing.assert_close(_gram(a, b), a.t() @ b, rtol=1e-13, atol=1e-12)


@pytest.mark.parametrize("kind", list(_FNS))
def test_fused_backward_with_some_inputs_constant(kind):
    """Only the weights need gradients (a first layer's data input): the rest are skipped."""
    args = _layer_args(kind, (4,), k=2, bias=True)
    n_inputs = 1 if kind == "deterministic" else 2
    args = [t.detach() if i < n_inputs else t for i, t in enumerate(args)]
    out = _FNS[kind](*args)
    assert type(out[0].grad_fn).__name__ == FUSED_NODES[kind]
    got = torch.autograd.grad(out, args[n_inputs:], [torch.ones_like(o) for o in out])
    with policy.fused_functions(False):
        ref = _FNS[kind](*args)
    want = torch.autograd.grad(ref, args[n_inputs:], [torch.ones_like(o) for o in ref])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_wide_head_and_batched_weights_take_autograd():
    """Outside the written-out layouts the formula is differentiated by autograd."""
    args = _layer_args("full_from_diag", (4,), k=20, bias=True)
    assert "Linear" not in type(linear_full_from_diag(*args)[1].grad_fn).__name__
    mean, var, w_loc, w_var, b_loc, b_var = _layer_args("diag", (4,), k=3, bias=True)
    batched = linear_diag(mean, var, w_loc.expand(2, 3, 5), w_var.expand(2, 3, 5), b_loc, b_var)
    assert "Linear" not in type(batched[0].grad_fn).__name__
    # a deterministic input that needs a gradient (an input-gradient attack, a feature
    # extractor below) takes autograd's two addmm nodes; data takes the fused node
    x = mean.detach()
    assert type(linear_deterministic(x, w_loc, w_var, b_loc, b_var)[0].grad_fn).__name__ == (
        "_LinearDeterministicBackward"
    )
    x.requires_grad_()
    assert type(linear_deterministic(x, w_loc, w_var, b_loc, b_var)[0].grad_fn).__name__ == (
        "AddmmBackward0"
    )


def test_policy_refuses_transforms_compile_and_subclasses():
    x = torch.randn(3, 2)
    assert policy.use_fused(x, None)
    with policy.fused_functions(False):
        assert not policy.use_fused(x)
    assert policy.use_fused(x)  # restored
    seen = []
    torch.func.vmap(lambda t: seen.append(policy.use_fused(t)) or t)(x)
    assert seen == [False]

    class Tagged(torch.Tensor):
        pass

    assert not policy.use_fused(x.as_subclass(Tagged))
    compiled = torch.compile(lambda t: t + float(policy.use_fused(t)), backend="eager")
    assert torch.equal(compiled(x), x)  # traced: the formula path (+ 0.0)


def test_fused_formula_under_vmap_matches_the_loop():
    """``torch.func`` transforms take the formula path; results agree with per-example calls."""
    args = [t.detach() for t in _layer_args("full_from_diag", (4,), k=2, bias=True)]
    mean, var, *params = args
    batched = torch.func.vmap(lambda m, v: linear_full_from_diag(m, v, *params))(mean, var)
    for i in range(4):
        single = linear_full_from_diag(mean[i], var[i], *params)
        for a, b in zip(batched, single, strict=True):
            torch.testing.assert_close(a[i], b, rtol=1e-13, atol=1e-13)


# --------------------------------------------------------------------------------- ReLU
def _relu_moments_reference(mean: torch.Tensor, var: torch.Tensor):
    """Textbook ReLU moments (no tail care), fine in float64 for |mu| <= 6."""
    sd = var.sqrt()
    mu = mean / sd
    cdf = 0.5 * torch.erfc(-mu / math.sqrt(2))
    pdf = torch.exp(-0.5 * mu * mu) / math.sqrt(2 * math.pi)
    first = mean * cdf + sd * pdf
    second = (mean * mean + var) * cdf + mean * sd * pdf
    return first, second - first * first


def test_relu_values_and_backward_match_the_textbook_formula_under_autograd():
    gen = torch.Generator().manual_seed(0)
    mu = torch.linspace(-6, 6, 61, dtype=F64)
    var = (torch.rand(61, dtype=F64, generator=gen) * 3 + 0.01).requires_grad_()
    mean = (mu * var.detach().sqrt()).requires_grad_()
    got = relu_diag(mean, var)
    want = _relu_moments_reference(mean, var)
    cot = [torch.randn(61, dtype=F64, generator=gen) for _ in range(2)]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-14)
    g_got = torch.autograd.grad(got, (mean, var), cot)
    g_want = torch.autograd.grad(want, (mean, var), cot)
    for a, b in zip(g_got, g_want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-13)


def test_relu_values_against_scipy_in_the_tail():
    """The Mills-ratio branch far in the lower tail, against scipy's truncated normal."""
    mu = torch.tensor([-3.0, -8.0, -15.0, -25.0], dtype=F64)
    mean, var = relu_diag(mu, torch.ones_like(mu))
    for m, out_m, out_v in zip(mu.tolist(), mean.tolist(), var.tolist(), strict=True):
        p = stats.norm.sf(-m)  # P(a > 0)
        tail = stats.truncnorm(-m, math.inf, loc=m, scale=1.0)
        e1, e2 = p * tail.mean(), p * (tail.var() + tail.mean() ** 2)
        assert out_m == pytest.approx(e1, rel=1e-9)
        assert out_v == pytest.approx(e2 - e1 * e1, rel=1e-6)


def test_relu_backward_passes_gradcheck():
    mu = torch.tensor([-30.0, -9.0, -3.0, -0.5, 0.3, 2.0, 7.0, 40.0], dtype=F64)
    var = torch.tensor([0.5, 2.0, 1.0, 1e-3, 3.0, 0.2, 1.0, 4.0], dtype=F64, requires_grad=True)
    mean = (mu * var.detach().sqrt()).requires_grad_()
    assert torch.autograd.gradcheck(relu_diag, (mean, var))


# ------------------------------------------------------------------------ whole steps
def _step_gradients(mode: str, hidden: list[int], fused: bool, seed: int = 0):
    torch.manual_seed(seed)
    net = mlp(6, hidden, 2).double()
    gen = torch.Generator().manual_seed(seed + 1)
    x, y = torch.randn(9, 6, dtype=F64, generator=gen), torch.randn(9, dtype=F64, generator=gen)
    with policy.fused_functions(fused):
        torch.manual_seed(seed + 2)  # the local mode's draws
        terms = elbo(net, HeteroscedasticGaussian(), EmpiricalBayes(), x, y, 100, mode=mode)
        grads = torch.autograd.grad(terms.loss, list(net.parameters()))
    return terms.loss.detach(), grads, net


@pytest.mark.parametrize("mode", ["diag", "full", "local"])
@pytest.mark.parametrize("hidden", [[7], [20, 20]])
def test_training_step_is_unchanged_by_the_fused_functions(mode, hidden):
    loss, grads, _ = _step_gradients(mode, hidden, fused=True)
    ref_loss, ref_grads, _ = _step_gradients(mode, hidden, fused=False)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-13, atol=0)
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-11, atol=1e-14)


def test_optimizer_step_is_unchanged_by_the_fused_functions():
    nets = []
    for fused in (True, False):
        _, grads, net = _step_gradients("diag", [20, 20], fused)
        opt = torch.optim.Adam(net.parameters(), lr=1e-2)
        for p, g in zip(net.parameters(), grads, strict=True):
            p.grad = g
        opt.step()
        nets.append(net)
    for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------------------- BatchNorm (fixed stats)
def _bn_args(shape: tuple[int, ...], seed: int = 0):
    """Inputs ``[B, C, *]``, running statistics and affine parameters ``[C]``."""
    gen = torch.Generator().manual_seed(seed)
    c = shape[1]
    mean = torch.randn(*shape, dtype=F64, generator=gen).requires_grad_()
    var = (torch.rand(*shape, dtype=F64, generator=gen) + 0.1).requires_grad_()
    mu = torch.randn(c, dtype=F64, generator=gen)
    sigma2 = torch.rand(c, dtype=F64, generator=gen) + 0.5
    weight = torch.randn(c, dtype=F64, generator=gen).requires_grad_()
    bias = torch.randn(c, dtype=F64, generator=gen).requires_grad_()
    return mean, var, mu, sigma2, weight, bias


@pytest.mark.parametrize("shape", [(5, 3), (4, 3, 2, 2), (2, 3, 5)])
def test_running_batch_norm_fused_matches_autograd_through_the_formula(shape):
    from lightning_dvi.moments.normalization import running_affine_diag

    mean, var, mu, sigma2, weight, bias = _bn_args(shape)
    # a few variances flushed to zero by the formula (no gradient passes there)
    with torch.no_grad():
        var.view(-1)[:2] = 1e-300
    fused, reference, got, want = _against_the_formula(
        lambda: running_affine_diag(mean, var, mu, sigma2, weight, bias, 1e-5),
        (mean, var, weight, bias),
        "_RunningAffineDiagBackward",
    )
    assert "RunningAffine" not in type(reference[0].grad_fn).__name__
    assert reference[1].view(-1)[:2].tolist() == [0.0, 0.0]
    for a, b in zip(fused, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=0)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert got[1].view(-1)[:2].tolist() == [0.0, 0.0]


def test_running_batch_norm_fused_passes_gradcheck_and_matches_an_affine_oracle():
    from lightning_dvi.moments.normalization import running_affine_diag

    mean, var, mu, sigma2, weight, bias = _bn_args((3, 2, 2, 2))
    eps = 1e-5
    args = (mean, var, mu, sigma2, weight, bias, eps)
    assert torch.autograd.gradcheck(running_affine_diag, args)
    # independent oracle: y = (a - mu) / sqrt(sigma2 + eps) * gamma + beta is affine in a
    out_mean, out_var = running_affine_diag(*args)
    mu, sigma2, weight, bias = (t.view(-1, 1, 1) for t in (mu, sigma2, weight, bias))
    s = weight / torch.sqrt(sigma2 + eps)
    torch.testing.assert_close(out_mean, (mean - mu) * s + bias, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(out_var, var * s**2, rtol=1e-13, atol=0)


def test_running_batch_norm_takes_autograd_for_learned_statistics_or_no_affine():
    from lightning_dvi.moments.normalization import running_affine_diag

    mean, var, mu, sigma2, weight, bias = _bn_args((4, 3))
    out = running_affine_diag(mean, var, mu.requires_grad_(), sigma2, weight, bias, 1e-5)
    assert "RunningAffine" not in type(out[0].grad_fn).__name__
    out = running_affine_diag(mean, var, mu.detach(), sigma2, None, None, 1e-5)
    assert "RunningAffine" not in type(out[0].grad_fn).__name__


def test_eval_batch_norm_module_takes_the_fused_node():
    from lightning_dvi import Gaussian
    from lightning_dvi.nn import BatchNorm2d

    bn = BatchNorm2d(3).double().eval()
    mean, var, *_ = _bn_args((2, 3, 2, 2))
    out = bn(Gaussian(mean, var=var), mode="diag")
    assert type(out.mean.grad_fn).__name__ == "_RunningAffineDiagBackward"
    with policy.fused_functions(False):
        ref = bn(Gaussian(mean, var=var), mode="diag")
    torch.testing.assert_close(out.mean, ref.mean, rtol=1e-14, atol=0)
    torch.testing.assert_close(out.var, ref.var, rtol=1e-14, atol=0)


# ------------------------------------------------------------- ReLU kernels (execution path)
@pytest.mark.parametrize("path", ["blocked", "whole", "compiled"])
def test_relu_runs_its_formula_compiled_only_where_the_policy_says(monkeypatch, path):
    """``"compiled"`` (CUDA with Triton by default) wraps the same forward and backward."""
    from lightning_dvi.moments import _relu

    wrapped = []

    def spy(name, fn, dynamic=None):
        assert dynamic is True  # one compilation for every shape
        wrapped.append(name)
        return fn  # the eager formula itself: the route is what is checked here

    monkeypatch.setattr(policy, "compiled", spy)
    monkeypatch.setattr(policy, "resolve", lambda device: path)
    mean = torch.tensor([-3.0, 0.5, 2.0], dtype=F64, requires_grad=True)
    var = torch.tensor([1.0, 0.2, 4.0], dtype=F64, requires_grad=True)
    out = _relu.relu_diag_fn(mean, var)
    torch.autograd.grad(out, (mean, var), [torch.ones(3, dtype=F64)] * 2)
    want = ["relu_diag_forward", "relu_diag_backward"] if path == "compiled" else []
    assert wrapped == want
    ref = _relu_moments_reference(mean.detach(), var.detach())
    for a, b in zip(out, ref, strict=True):
        torch.testing.assert_close(a.detach(), b, rtol=1e-10, atol=1e-14)


# ------------------------------------------------------------------------ conv2d (diag)
def _conv_args(bias: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(2, 3, 5, 5, dtype=F64, generator=gen)
    var = torch.rand(2, 3, 5, 5, dtype=F64, generator=gen) + 0.1
    w_loc = torch.randn(4, 3, 3, 3, dtype=F64, generator=gen)
    w_var = torch.rand(4, 3, 3, 3, dtype=F64, generator=gen) + 0.05
    b_loc = torch.randn(4, dtype=F64, generator=gen) if bias else None
    b_var = torch.rand(4, dtype=F64, generator=gen) + 0.05 if bias else None
    return [
        t.requires_grad_() if t is not None else None
        for t in (mean, var, w_loc, w_var, b_loc, b_var)
    ]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize(("stride", "padding"), [(1, 1), (2, 0), ((2, 1), (1, 0))])
def test_conv_fused_matches_autograd_through_the_formula(bias, stride, padding):
    from lightning_dvi.moments import conv2d_diag

    args = _conv_args(bias)
    fused, reference, got, want = _against_the_formula(
        lambda: conv2d_diag(*args, stride=stride, padding=padding),
        [t for t in args if t is not None],
        "_Conv2dDiagBackward",
    )
    assert "Conv2dDiag" not in type(reference[0].grad_fn).__name__
    for a, b in zip(fused, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_conv_fused_passes_gradcheck_and_matches_monte_carlo():
    from lightning_dvi.moments import conv2d_diag

    args = _conv_args(True)
    assert torch.autograd.gradcheck(
        lambda *a: conv2d_diag(*a, stride=2, padding=1), tuple(args), atol=1e-7
    )
    # only the kernel gradients (a frozen input): the input-gradient passes are skipped
    mean, var, *params = args
    out = conv2d_diag(mean.detach(), var.detach(), *params)
    got = torch.autograd.grad(out, params, [torch.ones_like(o) for o in out])
    with policy.fused_functions(False):
        ref = conv2d_diag(mean.detach(), var.detach(), *params)
    want = torch.autograd.grad(ref, params, [torch.ones_like(o) for o in ref])
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    # independent oracle: Monte Carlo over the first example's inputs and over the weights
    gen = torch.Generator().manual_seed(5)
    n = 20000
    m, v, wl, wv, bl, bv = (t.detach() for t in args)
    x = m[0] + v[0].sqrt() * torch.randn(n, 3, 5, 5, dtype=F64, generator=gen)
    w = wl + wv.sqrt() * torch.randn(n, *wl.shape, dtype=F64, generator=gen)
    b = bl + bv.sqrt() * torch.randn(n, 4, dtype=F64, generator=gen)
    draws = torch.nn.functional.conv2d(
        x.reshape(1, n * 3, 5, 5), w.reshape(n * 4, 3, 3, 3), b.reshape(-1), padding=1, groups=n
    ).reshape(n, 4, 5, 5)
    out_mean, out_var = conv2d_diag(m, v, wl, wv, bl, bv, padding=1)
    se = (out_var[0] / n).sqrt()
    assert ((draws.mean(0) - out_mean[0]).abs() < 5 * se).all()
    assert ((draws.var(0) / out_var[0] - 1).abs() < 5 * math.sqrt(2 / n) * 3).all()


@pytest.mark.parametrize("path", ["blocked", "compiled"])
def test_running_batch_norm_bodies_compiled_only_where_the_policy_says(monkeypatch, path):
    from lightning_dvi.moments.normalization import running_affine_diag

    wrapped = []
    monkeypatch.setattr(policy, "compiled", lambda name, fn, dynamic: wrapped.append(name) or fn)
    monkeypatch.setattr(policy, "resolve", lambda device: path)
    mean, var, mu, sigma2, weight, bias = _bn_args((2, 3, 2, 2))
    out = running_affine_diag(mean, var, mu, sigma2, weight, bias, 1e-5)
    torch.autograd.grad(out, (mean, var, weight, bias), [torch.ones_like(o) for o in out])
    want = ["running_affine_forward", "running_affine_backward"] if path == "compiled" else []
    assert wrapped == want
    # only the parameters need gradients (a frozen input): the eager partial backward
    wrapped.clear()
    out = running_affine_diag(mean.detach(), var.detach(), mu, sigma2, weight, bias, 1e-5)
    got = torch.autograd.grad(out, (weight, bias), [torch.ones_like(o) for o in out])
    assert wrapped == (["running_affine_forward"] if path == "compiled" else [])
    with policy.fused_functions(False):
        ref = running_affine_diag(mean.detach(), var.detach(), mu, sigma2, weight, bias, 1e-5)
    want_g = torch.autograd.grad(ref, (weight, bias), [torch.ones_like(o) for o in ref])
    for a, b in zip(got, want_g, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


# ------------------------------------------------------- heteroscedastic likelihood (packed)
def _packed_args(full: bool, lead: tuple[int, ...], seed: int = 0):
    """``(mean [..., 2], cov [..., 2, 2] or var [..., 2], y)``; the covariance is not symmetric
    so that the test also sees which entry is read."""
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(*lead, 2, dtype=F64, generator=gen)
    if full:
        a = torch.randn(*lead, 2, 2, dtype=F64, generator=gen)
        cov = a @ a.transpose(-1, -2) + 0.1 * torch.eye(2, dtype=F64)
        cov = cov + 0.01 * torch.randn(*lead, 2, 2, dtype=F64, generator=gen)
    else:
        cov = torch.rand(*lead, 2, dtype=F64, generator=gen) + 0.1
    y = torch.randn(lead, dtype=F64, generator=gen)
    return mean.requires_grad_(), cov.requires_grad_(), y


def _unpacked(mean, cov, y, extra):
    from lightning_dvi.likelihoods.functional import heteroscedastic_expected_log_prob

    if cov.dim() == mean.dim() + 1:
        var_m, cov_ml, var_l = cov[..., 0, 0], cov[..., 0, 1], cov[..., 1, 1]
    else:
        var_m, cov_ml, var_l = cov[..., 0], None, cov[..., 1]
    return heteroscedastic_expected_log_prob(
        mean[..., 0], var_m + extra, mean[..., 1], var_l, cov_ml, y
    )


@pytest.mark.parametrize("full", [True, False])
@pytest.mark.parametrize("lead", [(), (5,), (3, 4)])
@pytest.mark.parametrize("extra", [0.0, 0.3])
def test_packed_heteroscedastic_matches_the_formula_and_passes_gradcheck(full, lead, extra):
    from lightning_dvi.likelihoods.functional import heteroscedastic_expected_log_prob_packed

    mean, cov, y = _packed_args(full, lead)
    got = heteroscedastic_expected_log_prob_packed(mean, cov, y, extra)
    assert type(got.grad_fn).__name__ == "_HeteroscedasticELLBackward"
    want = _unpacked(mean, cov, y, extra)
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    cot = torch.randn(got.shape, dtype=F64, generator=torch.Generator().manual_seed(3))
    for a, b in zip(
        torch.autograd.grad(got, (mean, cov), cot),
        torch.autograd.grad(want, (mean, cov), cot),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    assert torch.autograd.gradcheck(
        lambda m, c: heteroscedastic_expected_log_prob_packed(m, c, y, extra), (mean, cov)
    )


@pytest.mark.parametrize("mode", ["diag", "full"])
def test_heteroscedastic_likelihood_takes_the_packed_node_only_where_it_may(mode):
    from lightning_dvi import Gaussian

    mean, cov, y = _packed_args(mode == "full", (6,))
    out = Gaussian(mean, cov=cov) if mode == "full" else Gaussian(mean, var=cov)
    lik = HeteroscedasticGaussian()
    got = lik.expected_log_prob(out, y)
    assert type(got.grad_fn).__name__ == "_HeteroscedasticELLBackward"
    with policy.fused_functions(False):
        want = lik.expected_log_prob(out, y)
    assert "Heteroscedastic" not in type(want.grad_fn).__name__
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    # a differentiable target (the input of an attack, say) takes the unpacked formula
    y_grad = y.clone().requires_grad_()
    assert "Heteroscedastic" not in type(lik.expected_log_prob(out, y_grad).grad_fn).__name__


def test_relu_float32_density_path_matches_float64():
    """The float32 forward forms phi(a) in float64 (no exact-product correction): float32 accuracy."""
    from lightning_dvi.moments._relu import _relu_diag_forward

    gen = torch.Generator().manual_seed(4)
    mu = torch.cat([torch.linspace(-8, 8, 4001, dtype=F64), 3 * torch.randn(4000, generator=gen)])
    var = torch.exp(torch.empty_like(mu).uniform_(-6, 4, generator=gen))
    mean = mu * var.sqrt()
    want = _relu_diag_forward(mean, var)
    got = _relu_diag_forward(mean.float(), var.float())
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        kept = (g != 0) & (w.abs() > 1e-25) & (mu.abs() < 6)  # the flushed tails aside
        rel = ((g.double() - w) / w)[kept].abs()
        assert rel.max() < 2e-3 and rel.quantile(0.99) < 1e-4
