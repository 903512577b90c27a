r"""Test log-likelihood against CPU time per split: the Adam protocol and the two L-BFGS ones.

Usage::

    python recipes/uci_time_to_quality.py --data-dir ../shared/data/uci --dataset boston \
        --splits 2 --json ttq.json --plot docs/uci_time_to_quality.png

Each point is one step budget of one protocol of :mod:`lightning_dvi_benchmarks.uci`, averaged
over the splits: ``adam8000`` capped at ``--adam-steps`` (its KL warm-up and cosine schedule
scale with the cap); ``lbfgs`` (the point-estimate warm start, then L-BFGS on the ELBO) and
``lbfgs-adam`` (a 300-step full-batch Adam phase, then L-BFGS) capped at ``--lbfgs-steps``
L-BFGS steps, plus each uncapped (early stopping decides). The warm start and the Adam phase are
not capped. CPU seconds are the worker's ``time.process_time`` (one thread, Trainer and data
set-up included).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lightning_dvi_benchmarks.uci import PRESETS, make_jobs, run


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def curve(args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """``{protocol: [{"steps_cap", "cpu_seconds", "test_ll"}, ...]}``, means over the splits."""
    lbfgs = [*_ints(args.lbfgs_steps), 0]
    budgets = {"adam8000": _ints(args.adam_steps), "lbfgs-adam": lbfgs, "lbfgs": lbfgs}
    points: dict[str, list[dict[str, Any]]] = {}
    for preset, caps in budgets.items():
        for cap in caps:
            jobs = make_jobs(Path(args.data_dir), [args.dataset], ["dvi"], PRESETS[preset],
                             args.splits, steps_cap=cap or None)  # fmt: skip
            (row,) = run(jobs, args.workers)
            points.setdefault(preset, []).append(
                {
                    "steps_cap": cap or None,
                    "cpu_seconds": row["cpu_seconds_per_split"],
                    "test_ll": row["test_ll_mean"],
                    "steps": [s["steps"] for s in row["splits"]],
                }
            )
            print(preset, cap or "early stopping", points[preset][-1], file=sys.stderr, flush=True)
    return points


def plot(points: dict[str, list[dict[str, Any]]], title: str, path: str) -> None:
    """Test LL against CPU seconds per split, one line per protocol, log-scaled time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "adam8000": "Adam, step budget",
        "lbfgs-adam": "Adam phase + L-BFGS, L-BFGS step budget",
        "lbfgs": "point warm start + L-BFGS (default), L-BFGS budget",
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    for preset, rows in points.items():
        xs, ys = [r["cpu_seconds"] for r in rows], [r["test_ll"] for r in rows]
        ax.plot(xs, ys, "o-", label=labels.get(preset, preset))
    ax.set_xscale("log")
    ax.set_xlabel("CPU seconds per split (1 thread, Trainer included)")
    ax.set_ylabel("test log-likelihood per point")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    """Entry point: run the budgets, write the JSON and the plot."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--dataset", default="boston")
    p.add_argument("--splits", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--adam-steps", default="500,1000,2000,4000,8000")
    p.add_argument("--lbfgs-steps", default="2,4,8,16")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    args = p.parse_args(argv)
    points = curve(args)
    if args.json:
        Path(args.json).write_text(json.dumps(points, indent=2) + "\n")
    if args.plot:
        plot(points, f"{args.dataset}, DVI, splits 0-{args.splits - 1}", args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
