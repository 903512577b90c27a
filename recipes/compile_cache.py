"""The compile cost of the ELBO step, cold and from inductor's on-disk cache (issue 39, item 2).

Runs the same compiled training step in two fresh interpreters that share one
``TORCHINDUCTOR_CACHE_DIR`` (a new temporary directory unless ``--cache-dir`` names one): the
first compiles cold, the second finds AOTAutograd's and inductor's compiled graphs in the
cache. Each child times, with one torch thread, the first compiled step (forward + backward)
minus a steady compiled step (the compile time: CPU seconds of the process, CPU seconds of its
child processes such as the C++ compiler, and wall seconds), then the steady compiled, eager
and plain steps in interleaved rounds (one round: ``--repeats`` steps of each; the median
round), where plain is a torch MLP of the same shape with a Gaussian NLL, and reports
inductor's FX-graph cache and AOTAutograd's cache counters.

``--step whole`` (the default) compiles the step as one graph, value and gradient
(``lightning_dvi.compile.compile_step``, what ``compile=True`` runs); ``--step forward`` the
objective's forward through ``torch.compile`` (``compile_elbo``).

Run:  python recipes/compile_cache.py [--width 50] [--batch 32] [--mode diag] [--step whole]
          [--cache-dir DIR]
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


def _interleaved(steps: dict[str, Any], repeats: int, rounds: int) -> dict[str, float]:
    """Median over ``rounds`` of the CPU seconds per step, the steps taking turns each round."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            start = time.process_time()
            for _ in range(repeats):
                step()
            times[name].append((time.process_time() - start) / repeats)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def child(
    width: int, batch: int, mode: str, repeats: int, rounds: int, step: str = "whole"
) -> dict[str, Any]:
    """One interpreter's measurements (CPU seconds)."""
    import torch
    from torch._dynamo.utils import counters

    from lightning_dvi.compile import compile_elbo, compile_step
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

    if step == "whole":  # what compile=True runs: the step, value and gradient, as one graph
        compiled: Any = compile_step(net, likelihood, prior, mode=mode)
    else:  # the objective's forward through torch.compile, backward by AOTAutograd
        compiled = compile_elbo(net, likelihood, prior, mode=mode)
    start, start_wall, start_children = time.process_time(), time.perf_counter(), _children_cpu()
    run(compiled)
    first = time.process_time() - start
    first_wall = time.perf_counter() - start_wall
    first_children = _children_cpu() - start_children
    start = time.process_time()
    run(compiled)  # the second step: what the first one minus the compile costs
    second = time.process_time() - start

    def eager(x: Any, y: Any, num_data: int) -> Any:
        return elbo(net, likelihood, prior, x, y, num_data=num_data, mode=mode)

    plain = torch.nn.Sequential(
        torch.nn.Linear(1, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
        torch.nn.ReLU(), torch.nn.Linear(width, 2),
    )  # fmt: skip

    def plain_step() -> None:
        plain.zero_grad(set_to_none=True)
        out = plain(x)
        torch.nn.functional.gaussian_nll_loss(out[:, 0], y, out[:, 1].exp()).backward()

    steps = {"compiled": lambda: run(compiled), "eager": lambda: run(eager), "plain": plain_step}
    median = _interleaved(steps, repeats, rounds)
    return {
        "compile_s": first - second,
        "compile_children_s": first_children,
        "compile_wall_s": first_wall,
        "compiled_step_ms": 1e3 * median["compiled"],
        "eager_step_ms": 1e3 * median["eager"],
        "plain_step_ms": 1e3 * median["plain"],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
        "autograd_cache_bypass": counters["aot_autograd"]["autograd_cache_bypass"],
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=50)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--mode", default="diag", choices=["diag", "full"])
    parser.add_argument(
        "--step",
        default="whole",
        choices=["whole", "forward"],
        help="whole: compile_step (compile=True); forward: compile_elbo",
    )
    parser.add_argument("--repeats", type=int, default=20, help="steps per round")
    parser.add_argument("--rounds", type=int, default=11, help="interleaved rounds")
    parser.add_argument("--jsonl", default=None, help="append each run's result to this file")
    parser.add_argument("--cache-dir", default=None, help="default: a new temporary directory")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = child(args.width, args.batch, args.mode, args.repeats, args.rounds, args.step)
        print(json.dumps(result))
        return 0
    cache = args.cache_dir or tempfile.mkdtemp(prefix="inductor-cache-")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
    command = [sys.executable, __file__, "--child", "--width", str(args.width)]
    command += ["--batch", str(args.batch), "--mode", args.mode, "--repeats", str(args.repeats)]
    command += ["--rounds", str(args.rounds), "--step", args.step]
    for run in ("cold", "warm"):
        out = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({"run": run, **vars(args), **result}) + "\n")
        ratio = result["compiled_step_ms"] / result["plain_step_ms"]
        print(
            f"{run}: compile {result['compile_s']:.1f} CPU s (+ {result['compile_children_s']:.1f}"
            f" in child processes; wall {result['compile_wall_s']:.1f} s); steps: compiled "
            f"{result['compiled_step_ms']:.3f} ms ({ratio:.2f}x plain), eager "
            f"{result['eager_step_ms']:.3f} ms, plain {result['plain_step_ms']:.3f} ms; "
            f"FX graph cache {result['fxgraph_cache_hit']} hit / {result['fxgraph_cache_miss']} "
            f"miss; AOTAutograd cache {result['autograd_cache_hit']} hit / "
            f"{result['autograd_cache_miss']} miss / {result['autograd_cache_bypass']} bypass"
        )
    print(f"cache: {cache}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
