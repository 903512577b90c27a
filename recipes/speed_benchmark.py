"""Speed: training steps, the paper's Fig. 4 layer scaling, front-end overhead, torch.compile.

One process, ``torch.set_num_threads(1)``; every number is the median CPU time over
``--repeats`` samples after warm-up calls (``--device cuda``: wall time between synchronisations,
peak memory by ``torch.cuda.max_memory_allocated``). Sections (``--sections``): ``steps`` and
``layer`` (:mod:`lightning_dvi_benchmarks.speed`), ``frontends`` (needs ``--data-dir`` for the
Lightning epoch), ``compile`` and ``net`` (:mod:`lightning_dvi_benchmarks.speed_net`), ``targets``
(issue 28's table, CPU only: :mod:`lightning_dvi_benchmarks.speed_targets`), ``cost`` (issue 39's
step-cost table, interleaved, with aten ops and the fixed/arithmetic split:
:mod:`lightning_dvi_benchmarks.speed_cost`), ``anatomy`` (CPU only, not run by default: where
each of those steps' CPU time goes, by :mod:`torch.profiler`, the compiled step kernel by kernel:
:mod:`lightning_dvi_benchmarks.speed_anatomy`); the harness is
:mod:`lightning_dvi_benchmarks.timing`. Results and the machine: docs/benchmarks.md.

Run:  python recipes/speed_benchmark.py [--quick] [--device cuda] [--json out.json]
          [--sections steps,layer,frontends,compile,net,targets,cost,anatomy] [--widths 128,512]
          [--data-dir DIR]
          [--count-ops]   (net section: aten ops / non-view ops / host reads per step)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Sequence
from typing import Any

import torch

from lightning_dvi_benchmarks import speed as S
from lightning_dvi_benchmarks.speed import (  # noqa: F401 - count_ops, peak_memory_mib: tests use them from here
    STEP_METHODS,
    bench_layer,
    bench_steps,
    count_ops,
    crossovers,
    describe_crossover,
    layer_kinds,
    make_step,
    op_rows,
    peak_memory_mib,
    step_ratios,
    table,
)
from lightning_dvi_benchmarks.speed_anatomy import ANATOMY_METHODS, bench_anatomy, report_anatomy
from lightning_dvi_benchmarks.speed_cost import (
    COMPILED_COST_METHODS,
    COST_METHODS,
    bench_cost,
    report_cost,
)
from lightning_dvi_benchmarks.speed_net import (  # noqa: F401 - net_step: tests use it from here
    NET_METHODS,
    bench_compile,
    bench_lightning,
    bench_net,
    bench_pyro_guide,
    net_step,
    report_net,
)
from lightning_dvi_benchmarks.speed_targets import bench_targets, report_targets


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the selected sections, print Markdown tables, optionally write JSON."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (smoke run)")
    p.add_argument("--json", metavar="PATH", help="also write every number to this JSON file")
    p.add_argument("--repeats", type=int, default=None, help="timed samples per number")
    p.add_argument("--sections", default="steps,layer,frontends,compile,net,targets,cost")
    p.add_argument(
        "--rounds", type=int, default=31, help="targets and cost sections: interleaved rounds"
    )
    p.add_argument("--data-dir", default=None, help="UCI data folder (frontends section)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--widths", default=None, help="net section widths, e.g. 128,512,1024,2048")
    p.add_argument("--batch", type=int, default=128, help="net section batch size")
    p.add_argument(
        "--compiled",
        default="auto",
        choices=("auto", "on", "off"),
        help="compiled columns of the net and cost sections (auto: on for cuda, off for cpu)",
    )
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend")
    p.add_argument("--compile-mode", default=None, help="torch.compile mode, e.g. reduce-overhead")
    p.add_argument(
        "--kernels",
        default="auto",
        choices=("auto", "blocked", "whole", "compiled"),
        help="lightning_dvi.moments.policy kernel backend (A/B runs)",
    )
    p.add_argument("--memory-budget", type=int, default=None, help="moments scratch bytes")
    p.add_argument(
        "--malloc",
        choices=("system", "reuse"),
        default="system",
        help="glibc allocator: as a bare loop gets it (system), or as the Lightning modules set it "
        "for a fit (reuse: lightning_dvi.moments.allocator.reuse_large_allocations)",
    )
    p.add_argument("--tf32", action="store_true", help="allow TF32 matmuls on CUDA (default off)")
    p.add_argument("--max-cell-s", type=float, default=60.0, help="skip slower methods after")
    p.add_argument(
        "--count-ops",
        action="store_true",
        help="net section: aten ops, non-view ops and host reads per step (+ CUDA kernels)",
    )
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device is available")
    S.DEVICE = torch.device(args.device)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = bool(args.tf32)
    from lightning_dvi.moments import policy

    if args.malloc == "reuse":  # for the rest of the process, as a fit sets it
        from lightning_dvi.moments.allocator import reuse_large_allocations

        reuse_large_allocations(True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    backend, budget = policy.get_kernel_backend(), policy.get_memory_budget()
    policy.set_kernel_backend(args.kernels)
    if args.memory_budget is not None:
        policy.set_memory_budget(args.memory_budget)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads)
        policy.set_kernel_backend(backend)  # type: ignore[arg-type]
        policy.set_memory_budget(budget)
        torch.backends.cuda.matmul.allow_tf32 = tf32
        S.DEVICE = torch.device("cpu")


def _run(args: argparse.Namespace) -> dict[str, Any]:
    repeats = args.repeats or (3 if args.quick else 21)
    sections = set(args.sections.split(","))
    result: dict[str, Any] = {
        "torch": torch.__version__, "python": platform.python_version(),
        "machine": platform.machine(), "threads": torch.get_num_threads(),
        "date": time.strftime("%Y-%m-%d %H:%M"), "argv": sys.argv[1:],
        "device": str(S.DEVICE), "kernels": args.kernels, "malloc": args.malloc,
    }  # fmt: skip
    if S.DEVICE.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(S.DEVICE)
        result["tf32"] = torch.backends.cuda.matmul.allow_tf32
    result["load_before"] = os.getloadavg()
    make_step("DVI", 16, 8)()  # first-call costs (lazy init, allocator) out of the first row
    if "steps" in sections:
        widths, batches = ((50,), (32,)) if args.quick else ((50, 128), (32, 512))
        rows = bench_steps(widths, batches, repeats)
        result["steps"], result["step_ratios"] = rows, step_ratios(rows)
        print("\n## Training step (ms, median)\n")
        print(table(rows, ["width", "batch"] + [m[0] for m in STEP_METHODS]))
        print("\n## Aten ops per step (forward + backward)\n")
        print(table([{"width": r["width"], "batch": r["batch"], **r["ops"]} for r in rows],
                    ["width", "batch"] + [m[0] for m in STEP_METHODS]))  # fmt: skip
        print("\n## Ratios\n")
        print(table(result["step_ratios"], list(result["step_ratios"][0]), "{:.2f}"))
    if "layer" in sections:
        dims = (16, 64) if args.quick else (16, 32, 64, 128, 256, 512, 1024)
        rows = bench_layer(dims, repeats, quick=args.quick)
        labels = [k[0] for k in layer_kinds(args.quick)]
        mcvi = [lab for lab in labels if lab.startswith("MCVI")]
        result["layer"] = rows
        result["crossover"] = {lab: crossovers(rows, lab) for lab in mcvi}
        print("\n## One d x d layer, batch 10, forward (ms, median)\n")
        print(table(rows, ["d", *labels, "DVI peak MiB"]))
        print(
            "\nDVI against MCVI:",
            "; ".join(f"{lab}: {describe_crossover(rows, lab)}" for lab in mcvi),
        )
    if "frontends" in sections:
        result["pyro_guide"] = bench_pyro_guide(50, 32, repeats)
        print("\n## Pyro DeterministicGuide step vs bare dDVI step (ms)\n")
        print(table([result["pyro_guide"]], list(result["pyro_guide"])))
        if args.data_dir is None:
            print("\n(Lightning epoch vs bare loop skipped: pass --data-dir with UCI power)")
        else:
            lit = bench_lightning(args.data_dir, 50, 64, 1 if args.quick else 10)
            result["lightning"] = lit
            print("\n## Lightning epoch vs bare loop, UCI power (s)\n")
            print(table([lit], list(lit)))
    if "compile" in sections and not args.quick:
        result["compile"] = bench_compile(repeats)
        print("\n## torch.compile (inductor), forward + backward\n")
        print(table(result["compile"], ["kernel", "eager ms", "compile s", "compiled ms"]))
    if "net" in sections:
        if args.widths:
            widths = [int(w) for w in args.widths.split(",")]
        elif args.quick:
            widths = [16, 32]
        else:
            widths = [128, 256, 512, 1024, 2048] if S.DEVICE.type == "cuda" else [32, 64, 128]
        compiled = args.compiled == "on" or (args.compiled == "auto" and S.DEVICE.type == "cuda")
        opts: dict[str, Any] | None = None
        if compiled:
            opts = {"backend": args.compile_backend}
            if args.compile_mode:
                opts["mode"] = args.compile_mode
        rows = bench_net(widths, repeats, opts, args.batch, args.max_cell_s, count=args.count_ops)
        result["net"] = rows
        print(report_net(rows, args.batch, compiled, args.count_ops))
    if "targets" in sections and S.DEVICE.type == "cpu":
        result["targets"] = bench_targets(3 if args.quick else args.rounds, args.quick)
        print(report_targets(result["targets"]))
    if "anatomy" in sections and S.DEVICE.type == "cpu":
        methods = ANATOMY_METHODS
        if args.compiled == "on":  # a CPU section: "auto" means off
            methods = (*ANATOMY_METHODS, "dDVI compiled step")
        rows = [(4, 3)] if args.quick else None
        result["anatomy"] = bench_anatomy(repeats, rows, methods)
        print(report_anatomy(result["anatomy"]))
    if "cost" in sections:
        methods = COST_METHODS
        if args.compiled == "on" or (args.compiled == "auto" and S.DEVICE.type == "cuda"):
            methods = (*COST_METHODS, *COMPILED_COST_METHODS)
        rows = bench_cost(
            3 if args.quick else args.rounds, [(50, 32)] if args.quick else None, methods
        )
        result["cost"] = rows
        print(report_cost(rows))
    result["load_after"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


if __name__ == "__main__":
    main()
