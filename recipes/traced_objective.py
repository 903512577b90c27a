"""The categorical objective's value and gradient, eager against recorded and compiled by inductor.

What a compiled training step (``compile=True``, ``CompiledDeterministicELBO``) spends on a
classifier's head: the expected log-likelihood of ``--rows`` data with ``--classes`` logits,
value and gradient, recorded with ``make_fx`` under ``policy.step_trace()`` (the library's
trace-safe paths: every branch on every row, no gathers) and compiled as
``lightning_dvi.compile`` compiles a step. The moments are random and wide (means
``4 N(0, 1)``, full covariances ``A Aᵀ/4 + 0.01 I`` with ``A`` standard normal: logit variances
of about 2.5), so the bound's costly branches run in eager mode too.

Methods: ``tight`` (the default), ``bound``, ``softplus`` (the softplus bound on the
covariance's diagonal, summed), ``series`` (its accelerated series alone). CPU time per call,
the median of ``--repeats`` samples (``lightning_dvi_benchmarks.timing.time_call``), one
thread.

Run:  python recipes/traced_objective.py [--rows 1401] [--classes 10] [--dtype float32]
          [--methods tight,bound,softplus,series] [--repeats 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from lightning_dvi.compile import _inductor
from lightning_dvi.likelihoods import functional as F
from lightning_dvi.likelihoods import logistic_normal
from lightning_dvi.moments import policy
from lightning_dvi_benchmarks.timing import time_call


def _diagonal(cov: Tensor) -> Tensor:
    return cov.diagonal(dim1=-2, dim2=-1)


METHODS: dict[str, Callable[[Tensor, Tensor, Tensor], Tensor]] = {
    "tight": F.categorical_tight_expected_log_prob,
    "bound": F.categorical_bound_expected_log_prob,
    "softplus": lambda m, c, y: F.softplus_normal_bound(m, _diagonal(c)).sum(-1),
    "series": lambda m, c, y: logistic_normal._softplus_series_bound(m, _diagonal(c)).sum(-1),
}


def head(rows: int, classes: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tensor, ...]:
    """Random wide head moments ``(mean [N, K], cov [N, K, K], labels [N])``."""
    gen = torch.Generator().manual_seed(seed)
    mean = 4 * torch.randn(rows, classes, generator=gen, dtype=torch.float64)
    a = torch.randn(rows, classes, classes, generator=gen, dtype=torch.float64) * 0.5
    cov = a @ a.mT + 0.01 * torch.eye(classes, dtype=torch.float64)
    y = torch.randint(classes, (rows,), generator=gen)
    return mean.to(dtype), cov.to(dtype), y


def measure(
    method: str, rows: int, classes: int, dtype: torch.dtype, repeats: int
) -> dict[str, float]:
    """Eager and compiled CPU ms per value-and-gradient call, and the compile's CPU seconds."""
    fn = METHODS[method]
    mean, cov, y = head(rows, classes, dtype)

    def step(m: Tensor, c: Tensor, labels: Tensor) -> tuple[Tensor, ...]:
        out = fn(m, c, labels).sum()
        return (out.detach(), *torch.autograd.grad(out, [m, c]))

    def eager() -> tuple[Tensor, ...]:
        return step(mean.clone().requires_grad_(), cov.clone().requires_grad_(), y)

    start = time.process_time()
    with policy.step_trace(), torch.enable_grad():
        graph = make_fx(step)(mean.clone().requires_grad_(), cov.clone().requires_grad_(), y)
    compiled = _inductor(graph, [mean, cov, y])
    compile_s = time.process_time() - start
    got, want = compiled(mean, cov, y), eager()
    scale = want[0].abs().clamp_min(1.0)
    return {
        "eager_ms": 1e3 * time_call(eager, repeats),
        "compiled_ms": 1e3 * time_call(lambda: compiled(mean, cov, y), repeats),
        "compile_s": compile_s,
        "value_rel_diff": float((got[0] - want[0]).abs() / scale),
    }


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    """Print and return the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1401)
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    results = {}
    print(f"[{args.rows}, {args.classes}] {args.dtype}, value and gradient, CPU ms per call:")
    print("| method | eager | compiled | compile (CPU s) | value, relative difference |")
    print("|---|---|---|---|---|")
    for method in args.methods.split(","):
        r = measure(method, args.rows, args.classes, dtype, args.repeats)
        results[method] = r
        print(
            f"| {method} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | "
            f"{r['compile_s']:.1f} | {r['value_rel_diff']:.1e} |"
        )
    return results


if __name__ == "__main__":
    main()
