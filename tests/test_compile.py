"""The hand-written ReLU moment kernels: gradients against finite differences, and tracing.

``lightning_dvi.moments`` evaluates the ReLU moments in custom autograd functions with
closed-form backward passes (and, for the full covariance, in cache-sized blocks of the upper
triangle). These tests check those derivatives against central finite differences in float64,
on one block and on many (forcing tiny blocks), including the Cauchy-Schwarz clamp path, and
that ``torch.compile`` can trace them (``backend="eager"``: Dynamo only, no code generation, so
the test stays fast; inductor itself was measured too slow to pay off, see docs/benchmarks.md).
"""

import pytest
import torch

import lightning_dvi.moments._relu_cov as relu_cov_module
from lightning_dvi.moments import relu_diag, relu_full
from lightning_dvi.moments._relu_cov import relu_cov

DT = torch.float64


def _psd(gen: torch.Generator, b: int, d: int) -> torch.Tensor:
    a = torch.randn(b, d, d, generator=gen, dtype=DT)
    cov = a @ a.transpose(-1, -2) / d + 0.05 * torch.eye(d, dtype=DT)
    return 0.5 * (cov + cov.transpose(-1, -2))


def test_relu_diag_gradient_matches_finite_differences():
    gen = torch.Generator().manual_seed(0)
    # both signs of mu, the far lower tail and a huge positive mean
    mean = torch.tensor([-9.0, -3.0, -0.4, 0.0, 0.7, 2.5, 40.0], dtype=DT)
    var = torch.rand(7, generator=gen, dtype=DT) + 0.2
    assert torch.autograd.gradcheck(relu_diag, (mean.requires_grad_(), var.requires_grad_()))


@pytest.mark.parametrize("block", [12, 1 << 16])
def test_relu_full_gradient_matches_finite_differences(monkeypatch, block):
    monkeypatch.setattr(relu_cov_module, "BLOCK", block)  # many blocks, bands and one block
    gen = torch.Generator().manual_seed(1)
    cov = _psd(gen, 2, 5)
    mean = torch.randn(2, 5, generator=gen, dtype=DT)

    def f(m: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        out_mean, out_cov = relu_full(m, c.triu() + c.triu(1).transpose(-1, -2))
        return torch.cat([out_mean.flatten(), out_cov.flatten()])

    assert torch.autograd.gradcheck(f, (mean.requires_grad_(), cov.requires_grad_()))


def test_relu_full_gradient_through_cauchy_schwarz_clamp(monkeypatch):
    # tiny output variances make the clamp |C_jl| <= sqrt(V_j V_l) bind on most entries
    monkeypatch.setattr(relu_cov_module, "BLOCK", 10)
    gen = torch.Generator().manual_seed(2)
    cov = _psd(gen, 2, 5).triu()  # only the upper triangle is read
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    mu = torch.randn(2, 5, generator=gen, dtype=DT)
    cdf = torch.special.ndtr(mu)
    var = 0.02 * torch.rand(2, 5, generator=gen, dtype=DT) + 1e-3
    inputs = tuple(t.clone().requires_grad_() for t in (cov, sd, mu, cdf, var))
    assert torch.autograd.gradcheck(relu_cov, inputs)


def test_blocked_result_is_exactly_symmetric_and_block_independent(monkeypatch):
    gen = torch.Generator().manual_seed(3)
    cov, mean = _psd(gen, 4, 11).float(), torch.randn(4, 11, generator=gen)
    results = []
    for block in (9, 60, 1 << 16):
        monkeypatch.setattr(relu_cov_module, "BLOCK", block)
        results.append(relu_full(mean, cov)[1])
    for out in results:
        assert torch.equal(out, out.transpose(-1, -2))
        torch.testing.assert_close(out, results[-1], rtol=1e-6, atol=1e-7)


def test_moment_kernels_trace_under_torch_compile():
    gen = torch.Generator().manual_seed(4)
    cov, mean = _psd(gen, 2, 4), torch.randn(2, 4, generator=gen, dtype=DT)
    compiled_full = torch.compile(relu_full, backend="eager")
    compiled_diag = torch.compile(relu_diag, backend="eager")
    torch.testing.assert_close(compiled_full(mean, cov), relu_full(mean, cov))
    var = cov.diagonal(dim1=-2, dim2=-1)
    torch.testing.assert_close(compiled_diag(mean, var), relu_diag(mean, var))
