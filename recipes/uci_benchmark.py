r"""UCI regression benchmark: the paper's Table 2 (and Table 4's DVI-fixed), with CPU time per split.

Usage::

    python recipes/uci_benchmark.py --data-dir ../shared/data/uci \
        --dataset boston,concrete --method dvi,mcvi [--splits K] [--output results.json]

A short script over :mod:`lightning_dvi_benchmarks.uci` (the runner: one
:class:`lightning_dvi.DVIRegressor` per split through ``lightning.Trainer`` on a
:class:`lightning_dvi.data.UCIDataModule`, scored in the original units of ``y``) and
:mod:`lightning_dvi_benchmarks.tables` (the summary and markdown table). ``--preset lbfgs``
(default): the means fitted as a plain network first (the point-estimate warm start), then
full-batch L-BFGS on the ELBO, both early-stopped on a 10 % validation carve-out of the training
rows, and on a training set of more than 5,000 rows (``--large-rows``) the large-table protocol
instead: the warm start and at most 20 L-BFGS steps on 4,096 seeded rows, then 16 epochs of
mini-batch Adam on every row (docs/uci_large.md); ``--preset lbfgs-full-batch``: the
full-batch protocol at every size; ``--preset lbfgs-adam``: a 300-step full-batch Adam phase instead of the warm start (the
protocol until the seventh pass of issue 31); ``--preset adam8000``: the 8000-step Adam protocol
of the committed paper-reproduction table. Methods: ``dvi`` (full covariance), ``ddvi`` (diagonal), ``mcvi`` (10 weight samples per
step, always Adam), ``hodvi`` (homoscedastic), ``dvi-fixed`` (fixed ``N(0, v)`` prior). Every
field of :class:`~lightning_dvi_benchmarks.uci.Settings` has a flag (``--lr``, ``--patience``
...), defaulting to the preset's value.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

from lightning_dvi_benchmarks.tables import markdown_table
from lightning_dvi_benchmarks.uci import METHODS, PAPER, PRESETS, Job, make_jobs, run


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="directory with one folder per dataset")
    p.add_argument("--dataset", required=True, help="comma-separated dataset folder names")
    p.add_argument("--method", required=True, help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--preset", default="lbfgs", choices=sorted(PRESETS), help="(default lbfgs)")
    p.add_argument("--splits", type=int, default=None, help="run the first K splits (default all)")
    p.add_argument("--output", default=None, help="write the results JSON here")
    p.add_argument("--workers", type=int, default=2, help="parallel processes (1 thread each)")
    p.add_argument("--max-steps", type=int, default=None, help="cap steps per run (smoke tests)")
    p.add_argument(
        "--validation",
        type=float,
        default=0.0,
        help="score on this fraction of the TRAINING split held out (hyper-parameter search; "
        "no early stopping then); 0 scores on the test split",
    )
    for field in fields(PRESETS["lbfgs"]):
        flag = "max-steps-budget" if field.name == "max_steps" else field.name.replace("_", "-")
        kind = (
            str
            if field.name in ("optimizer", "precision", "target_resolution", "warm_start")
            else type(getattr(PRESETS["lbfgs"], field.name))
        )
        p.add_argument(f"--{flag}", type=kind, default=None, dest=f"set_{field.name}",
                       help="(default: the preset's)")  # fmt: skip
    return p


def _names(text: str, what: str) -> list[str]:
    names = list(dict.fromkeys(s.strip() for s in text.split(",") if s.strip()))
    if not names:
        raise ValueError(f"--{what} needs at least one name")
    return names


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[Job]]:
    """Parse and validate the command line; returns the arguments and the jobs to run.

    Raises:
        ValueError: for an unknown method or dataset, a bad ``--splits`` or other bad values.
    """
    args = build_parser().parse_args(argv)
    data_dir = Path(args.data_dir).expanduser()
    if not data_dir.is_dir():
        raise ValueError(f"--data-dir {data_dir} is not a directory")
    overrides = {
        f.name: getattr(args, f"set_{f.name}")
        for f in fields(PRESETS[args.preset])
        if getattr(args, f"set_{f.name}") is not None
    }
    settings = replace(PRESETS[args.preset], **overrides)
    if settings.optimizer not in ("lbfgs", "adam"):
        raise ValueError(f"--optimizer must be lbfgs or adam, got {settings.optimizer!r}")
    if settings.warm_start not in ("point", "adam", "none"):
        raise ValueError(f"--warm-start must be point, adam or none, got {settings.warm_start!r}")
    if settings.precision not in ("32-true", "64-true"):
        raise ValueError(f"--precision must be 32-true or 64-true, got {settings.precision!r}")
    for name, value in (("splits", args.splits), ("max-steps", args.max_steps)):
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be >= 1, got {value}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    warm, ramp = settings.kl_warmup, settings.kl_anneal
    if min(warm, ramp) < 0.0 or warm + ramp > 1.0:
        raise ValueError(
            f"--kl-warmup and --kl-anneal are fractions of the steps, >= 0 with a sum <= 1; got "
            f"{warm} and {ramp}"
        )
    if not 0.0 <= args.validation < 1.0:
        raise ValueError(f"--validation must lie in [0, 1), got {args.validation}")
    if not 0.0 <= settings.early_stopping_fraction < 1.0:
        raise ValueError("--early-stopping-fraction must lie in [0, 1)")
    if not settings.grad_clip >= 0.0:
        raise ValueError(f"--grad-clip must be >= 0 (0 = no clipping), got {settings.grad_clip}")
    jobs = make_jobs(
        data_dir,
        _names(args.dataset, "dataset"),
        _names(args.method, "method"),
        settings,
        args.splits,
        args.validation,
        args.max_steps,
    )
    return args, jobs


def _print_result(job: Job, result: dict[str, Any]) -> None:
    print(
        f"{job.dataset:>10} {job.method:>9} split {job.split:>2}: test LL "
        f"{result['test_ll']:8.4f}  RMSE {result['rmse']:8.4f}  {result['steps']} steps  "
        f"{result['cpu_seconds']:6.2f} CPU s  {result['seconds']:6.1f} s",
        file=sys.stderr,
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, run, print the markdown table, write the JSON."""
    try:
        args, jobs = parse_args(argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    results = run(jobs, args.workers, _print_result)
    wall = time.perf_counter() - start
    print(markdown_table(results, PAPER))
    print(f"\n{len(jobs)} runs, wall time {wall:.0f} s", flush=True)
    if args.output:
        payload = {
            "results": results,
            "wall_seconds": wall,
            "preset": args.preset,
            "settings": asdict(jobs[0].settings) if jobs else {},
            "validation_fraction": args.validation,
            "max_steps_cap": args.max_steps,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]
            if Path("/proc/loadavg").is_file()
            else None,
        }
        Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
