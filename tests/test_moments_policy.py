"""The execution policy of the full-covariance kernels (``lightning_dvi.moments.policy``).

The whole-tensor ReLU/Heaviside covariances (the GPU path) and their ``torch.compile`` path
against the CPU blocked path in float64 to 1e-6 relative, values and gradients, on random
covariances and at the edges (correlations near +-1, exactly 0, tiny variances, the
Cauchy-Schwarz clamp); chunking over the batch changes nothing; the path chosen per device;
no host read and no per-matrix loop on the whole-tensor path. The compiled path is tested with
``backend="aot_eager"`` (traced and functionalised like inductor's input, no code generation)
so the file stays fast; inductor itself was checked by hand (see docs/benchmarks.md).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_dvi.moments import heaviside_full, policy, relu_full
from lightning_dvi.moments._relu_cov import relu_cov

DT = torch.float64


@pytest.fixture(autouse=True)
def _fresh_policy():
    yield
    policy.set_compile_options()  # back to the defaults, forgets compiled kernels and failures


def _case(kind: str, b: int = 3, d: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(hash(kind) % 1000)
    mean = torch.randn(b, d, generator=gen, dtype=DT)
    if kind == "random":
        a = torch.randn(b, d, d, generator=gen, dtype=DT)
        cov = a @ a.mT / d + 0.05 * torch.eye(d, dtype=DT)
    elif kind == "rho_near_one":  # units 0, 1 and 2 nearly (anti-)collinear: |rho| -> 1
        a = torch.randn(b, d, d, generator=gen, dtype=DT)
        a[:, 1] = a[:, 0] + 1e-7 * a[:, 1]
        a[:, 2] = -a[:, 0] + 1e-5 * a[:, 2]
        cov = a @ a.mT / d + 1e-12 * torch.eye(d, dtype=DT)
    elif kind == "rho_zero":  # exactly diagonal: rho = 0 off the diagonal
        cov = torch.diag_embed(torch.rand(b, d, generator=gen, dtype=DT) + 0.1)
    elif kind == "tiny_var":  # variances ~1e-20 next to O(1) ones, large standardised means
        a = torch.randn(b, d, d, generator=gen, dtype=DT)
        scale = torch.ones(d, dtype=DT)
        scale[: d // 2] = 1e-10
        a = a * scale[:, None]
        cov = a @ a.mT / d
        mean = mean * 1e-9
    else:
        raise AssertionError(kind)
    return mean, 0.5 * (cov + cov.mT)


def _values_and_grads(fn, mean, cov, backend, budget=None):
    m, c = mean.clone().requires_grad_(), cov.clone().requires_grad_()
    with policy.kernel_backend(backend), policy.memory_budget(budget or policy.get_memory_budget()):
        out_mean, out_cov = fn(m, c)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(out_cov.shape, generator=gen, dtype=DT)
    (out_cov * w).sum().add(out_mean.sum()).backward()
    return out_cov.detach(), m.grad, c.grad


def _close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """1e-6 relative to the tensor's scale (elementwise relative error is meaningless at 0)."""
    scale = expected.abs().max().clamp_min(torch.finfo(DT).tiny)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6 * scale.item())


@pytest.mark.parametrize("kind", ["random", "rho_near_one", "rho_zero", "tiny_var"])
@pytest.mark.parametrize("fn", [relu_full, heaviside_full], ids=["relu", "heaviside"])
def test_whole_tensor_path_matches_blocked_path(fn, kind):
    mean, cov = _case(kind)
    expected = _values_and_grads(fn, mean, cov, "blocked")
    actual = _values_and_grads(fn, mean, cov, "whole")
    for a, e in zip(actual, expected, strict=True):
        assert torch.isfinite(a).all()
        _close(a, e)
    assert torch.equal(actual[0], actual[0].mT)


def test_whole_tensor_relu_gradient_matches_finite_differences_through_the_clamp():
    # tiny output variances: the Cauchy-Schwarz clamp binds on most entries
    gen = torch.Generator().manual_seed(2)
    mean, cov = _case("random", 2, 5)
    cov = cov.triu()  # only the upper triangle is read
    sd = cov.diagonal(dim1=-2, dim2=-1).sqrt()
    mu = mean / sd
    var = 0.02 * torch.rand(2, 5, generator=gen, dtype=DT) + 1e-3
    inputs = tuple(t.clone().requires_grad_() for t in (cov, sd, mu, torch.special.ndtr(mu), var))
    with policy.kernel_backend("whole"):
        assert torch.autograd.gradcheck(relu_cov, inputs)
        blocked_free = relu_cov(*inputs)
    with policy.kernel_backend("blocked"):
        _close(blocked_free, relu_cov(*inputs))


@pytest.mark.parametrize("fn", [relu_full, heaviside_full], ids=["relu", "heaviside"])
def test_chunking_over_the_batch_changes_nothing(fn):
    mean, cov = _case("random", b=5)
    whole = _values_and_grads(fn, mean, cov, "whole")
    per_matrix = 16 * 6 * 6 * 8  # SCRATCH_ARRAYS["whole"] [1, 6, 6] float64 arrays
    assert policy.chunk_size(5, 6, DT, "whole") == 5
    with policy.memory_budget(2 * per_matrix):
        assert policy.chunk_size(5, 6, DT, "whole") == 2  # chunks of 2, 2, 1
    chunked = _values_and_grads(fn, mean, cov, "whole", budget=2 * per_matrix)
    for a, e in zip(chunked, whole, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-15, atol=1e-16)


@pytest.mark.parametrize("fn", [relu_full, heaviside_full], ids=["relu", "heaviside"])
def test_compiled_path_matches_blocked_path(fn):
    policy.set_compile_options(backend="aot_eager")
    for kind in ("random", "rho_near_one"):
        mean, cov = _case(kind)
        expected = _values_and_grads(fn, mean, cov, "blocked")
        actual = _values_and_grads(fn, mean, cov, "compiled")
        for a, e in zip(actual, expected, strict=True):
            _close(a, e)


def test_failed_compilation_falls_back_to_eager_with_one_warning():
    policy.set_compile_options(backend="no_such_backend")
    mean, cov = _case("random")
    expected = _values_and_grads(relu_full, mean, cov, "whole")
    # the first kernel compiled fails: the diagonal ReLU (relu_full calls it) or the covariance
    with pytest.warns(RuntimeWarning, match="torch.compile of relu_(diag|cov)_forward failed"):
        actual = _values_and_grads(relu_full, mean, cov, "compiled")
    for a, e in zip(actual, expected, strict=True):
        torch.testing.assert_close(a, e, rtol=0, atol=0)
    with policy.kernel_backend("compiled"):
        assert policy.resolve(torch.device("cpu")) == "whole"  # and it stays there


def test_policy_picks_the_path_for_the_device():
    select = policy.select_backend
    assert select("cpu", backend="auto") == "blocked"
    assert select("cuda:0", backend="auto", has_triton=True) == "compiled"
    assert select(torch.device("cuda", 1), backend="auto", has_triton=False) == "whole"
    assert select("mps", backend="auto") == "whole"
    assert select("meta", backend="auto") == "whole"
    for device in ("cpu", "cuda"):
        assert select(device, backend="auto", tracing=True, has_triton=True) == "whole"
        assert select(device, backend="blocked") == "blocked"
        assert select(device, backend="whole", has_triton=True) == "whole"
    with policy.kernel_backend("whole"):
        assert select("cpu") == "whole"
    assert policy.get_kernel_backend() == "auto"


def test_knobs_reject_bad_values(monkeypatch):
    with pytest.raises(ValueError, match="kernel backend must be one of"):
        policy.set_kernel_backend("triton")  # type: ignore[arg-type]
    for bad in (0, -1, 1.5, True, "1GiB"):
        with pytest.raises(ValueError, match="memory budget must be a positive int"):
            policy.set_memory_budget(bad)  # type: ignore[arg-type]
    monkeypatch.setenv("LIGHTNING_DVI_MEMORY_BUDGET", "1e9")
    assert policy._env_budget() == 10**9
    monkeypatch.setenv("LIGHTNING_DVI_MEMORY_BUDGET", "lots")
    with pytest.raises(ValueError, match="LIGHTNING_DVI_MEMORY_BUDGET"):
        policy._env_budget()
    monkeypatch.setenv("LIGHTNING_DVI_KERNELS", "gpu")
    with pytest.raises(ValueError, match="LIGHTNING_DVI_KERNELS"):
        policy._env_backend()


class _OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fn", [relu_full, heaviside_full], ids=["relu", "heaviside"])
def test_whole_path_has_no_host_reads_and_no_loop_over_matrices(fn):
    counts = []
    for b in (2, 9):
        mean, cov = _case("random", b=b, d=7)
        mean.requires_grad_()
        with policy.kernel_backend("whole"), _OpCounter() as counter:
            out_mean, out_cov = fn(mean, cov.requires_grad_())
            (out_cov.sum() + out_mean.sum()).backward()
        assert not [op for op in counter.ops if "item" in op or "is_nonzero" in op]
        counts.append(len(counter.ops))
    assert counts[0] == counts[1]  # the same kernels whatever the batch
    # and it traces as one graph (a host read would be a graph break under fullgraph=True)
    mean, cov = _case("random", b=2, d=4)
    traced = torch.compile(fn, backend="eager", fullgraph=True)
    torch.testing.assert_close(traced(mean, cov), fn(mean, cov))
