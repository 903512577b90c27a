"""The compile cost of the ELBO step, cold and from inductor's on-disk cache (issue 39, item 2).

Runs the same compiled training step in two fresh interpreters that share one
``TORCHINDUCTOR_CACHE_DIR`` (a new temporary directory unless ``--cache-dir`` names one): the
first compiles cold, the second finds inductor's compiled graphs in the cache. Each child times,
with one torch thread, the first compiled step (forward + backward) minus a steady compiled
step (the compile time), the steady compiled and eager steps, and a plain torch MLP's step of
the same shape, and reports inductor's FX-graph cache hits and AOTAutograd cache hits.

Run:  python recipes/compile_cache.py [--width 50] [--batch 32] [--mode diag] [--cache-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any


def _median_step(step: Any, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        step()
        times.append(time.process_time() - start)
    return sorted(times)[len(times) // 2]


def child(width: int, batch: int, mode: str, repeats: int) -> dict[str, Any]:
    """One interpreter's measurements (CPU seconds)."""
    import torch
    from torch._dynamo.utils import counters

    from lightning_dvi.compile import compile_elbo
    from lightning_dvi.likelihoods import HeteroscedasticGaussian
    from lightning_dvi.nn import mlp
    from lightning_dvi.objective import elbo
    from lightning_dvi.priors import GaussianPrior

    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = mlp(1, [width, width], 2)
    x, y = torch.randn(batch, 1), torch.randn(batch)
    likelihood, prior = HeteroscedasticGaussian(), GaussianPrior()

    def run(elbo: Any) -> None:
        net.zero_grad(set_to_none=True)
        elbo(x, y, num_data=1000).loss.backward()

    compiled = compile_elbo(net, likelihood, prior, mode=mode)
    start = time.process_time()
    run(compiled)
    first = time.process_time() - start
    compiled_step = _median_step(lambda: run(compiled), repeats)

    def eager(x: Any, y: Any, num_data: int) -> Any:
        return elbo(net, likelihood, prior, x, y, num_data=num_data, mode=mode)

    eager_step = _median_step(lambda: run(eager), repeats)
    plain = torch.nn.Sequential(
        torch.nn.Linear(1, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 2),
    )  # fmt: skip

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        out = plain(x)
        torch.nn.functional.gaussian_nll_loss(out[:, 0], y, out[:, 1].exp()).backward()

    plain_time = _median_step(plain_step, repeats)
    return {
        "compile_s": first - compiled_step,
        "compiled_step_ms": 1e3 * compiled_step,
        "eager_step_ms": 1e3 * eager_step,
        "plain_step_ms": 1e3 * plain_time,
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_bypass": counters["aot_autograd"]["autograd_cache_bypass"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mode", default="diag", choices=["diag", "full"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--cache-dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.width, args.batch, args.mode, args.repeats)))
        return 0
    cache = args.cache_dir or tempfile.mkdtemp(prefix="inductor-cache-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    command = [sys.executable, __file__, "--child", "--width", str(args.width)]
    command += ["--batch", str(args.batch), "--mode", args.mode, "--repeats", str(args.repeats)]
    for run in ("cold", "warm"):
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        ratio = result["compiled_step_ms"] / result["plain_step_ms"]
        print(
            f"{run}: compile {result['compile_s']:.1f} CPU s; steps: compiled "
            f"{result['compiled_step_ms']:.3f} ms ({ratio:.2f}x plain), eager "
            f"{result['eager_step_ms']:.3f} ms, plain {result['plain_step_ms']:.3f} ms; "
            f"FX graph cache {result['fxgraph_cache_hit']} hit / {result['fxgraph_cache_miss']} "
            f"miss; AOTAutograd cache {result['autograd_cache_hit']} hit / "
            f"{result['autograd_cache_bypass']} bypass"
        )
    print(f"cache: {cache}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
