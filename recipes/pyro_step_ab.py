"""One SVI step of AutoNormal against DeterministicGuide: eager, without the same-shape rule, compiled.

The A/B of the Pyro step-cost work of issue 39 (item 3): in one process, from the same seed,
up to four runs on the Pyro tutorial classifier of ``recipes/pyro_classifier_swap.py`` (full
batch):

* ``autonormal``: ``AutoNormal`` + ``Trace_ELBO``;
* ``dvi``: ``DeterministicGuide`` + ``DeterministicELBO`` as the library runs it;
* ``dvi_before``: the same with the moment rule for shape ops that move no element switched off
  (``lightning_dvi.pyro.moment_rules._IDENTITY_IF_SAME_SHAPE`` emptied for its steps), so that
  the plate's ``dist.expand`` gathers the head's ``[N, K, K]`` covariance as before the change;
* ``dvi_compiled``: ``DeterministicGuide`` + ``CompiledDeterministicELBO``: the step recorded
  as one graph at its second step and compiled (inductor; ``--backend`` for another
  ``torch.compile`` backend). That step's CPU time, the recording and the compile, is printed
  and kept out of the rounds.

Each run takes ``--warmup`` ``pyro.optim.Adam({"lr": 1e-2})`` steps (the first from the same
seed), then ``--rounds`` rounds of one step of each, in rotating order, timed by CPU
(``time.process_time``) and wall clock. One JSON line per round goes to ``--json`` (appended,
written as it goes), with each run's loss: ``dvi`` and ``dvi_before`` must report the same loss
at every step, ``dvi_compiled`` the same to float32 rounding (its largest relative difference
is printed). One torch thread.

Run:  .venv/bin/python recipes/pyro_step_ab.py --data digits --rounds 60 --json ab.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pyro
import torch
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling recipe's model and data
from pyro_classifier_swap import Classifier, load

from lightning_dvi.pyro import (
    CompiledDeterministicELBO,
    DeterministicELBO,
    DeterministicGuide,
    moment_rules,
)

RUNS = ("autonormal", "dvi", "dvi_before", "dvi_compiled")


def main(argv: list[str] | None = None) -> dict:
    """Run the rounds; print and return the mean and median CPU ms per step of each run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("digits", "cancer", "parity"), default="digits")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", default=",".join(RUNS), help="a comma-separated subset")
    parser.add_argument("--backend", default=None, help="torch.compile backend of dvi_compiled")
    parser.add_argument("--json", default=None, help="append one JSON line per round here")
    args = parser.parse_args(argv)
    kinds = tuple(k for k in RUNS if k in args.runs.split(","))
    if "autonormal" not in kinds or args.warmup < 2:
        parser.error("--runs must include autonormal (the reference) and --warmup be >= 2")
    torch.set_num_threads(1)
    x, y, _, _ = load(args.data, args.seed)
    classes = int(y.max()) + 1
    pyro.clear_param_store()
    same_shape_rule = moment_rules._IDENTITY_IF_SAME_SHAPE
    runs: dict[str, SVI] = {}
    for kind in kinds:
        model = Classifier(x.shape[1], classes, "categorical")
        if kind == "autonormal":
            guide = type("AutoNormal_step_ab", (AutoNormal,), {})(model)
            runs[kind] = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
            continue
        guide = DeterministicGuide(model, name=f"DeterministicGuide_{kind}")
        options = {} if args.backend is None else {"backend": args.backend}
        elbo = (
            CompiledDeterministicELBO(**options) if kind == "dvi_compiled" else DeterministicELBO()
        )
        runs[kind] = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), elbo)

    def step(kind: str) -> tuple[float, float, float]:
        moment_rules._IDENTITY_IF_SAME_SHAPE = (
            frozenset() if kind == "dvi_before" else same_shape_rule
        )
        try:
            cpu, wall = time.process_time(), time.perf_counter()
            loss = runs[kind].step(x, y)
            return 1e3 * (time.process_time() - cpu), 1e3 * (time.perf_counter() - wall), loss
        finally:
            moment_rules._IDENTITY_IF_SAME_SHAPE = same_shape_rule

    identical, compiled_diff = True, 0.0

    def compare(losses: dict[str, float]) -> None:
        nonlocal identical, compiled_diff
        if "dvi" in losses and "dvi_before" in losses:
            identical &= losses["dvi"] == losses["dvi_before"]
        if "dvi" in losses and "dvi_compiled" in losses:
            compiled_diff = max(compiled_diff, abs(losses["dvi_compiled"] / losses["dvi"] - 1))

    for kind in kinds:  # the first step creates each guide's parameters: from the same seed
        pyro.set_rng_seed(args.seed)
        step(kind)
    summary: dict = {}
    for i in range(args.warmup - 1):
        steps = {kind: step(kind) for kind in kinds}
        compare({kind: loss for kind, (_, _, loss) in steps.items()})
        if i == 0 and "dvi_compiled" in kinds:  # its second step recorded and compiled
            summary["compile_cpu_s"] = steps["dvi_compiled"][0] / 1e3
            print(
                f"dvi_compiled: recording and compiling took {summary['compile_cpu_s']:.1f} CPU s"
            )
    out = open(args.json, "a") if args.json else None  # noqa: SIM115 - closed below
    cpu: dict[str, list[float]] = {kind: [] for kind in kinds}
    try:
        for r in range(args.rounds):
            record: dict = {"round": r, "load": os.getloadavg()[0], "data": args.data}
            for kind in kinds[r % len(kinds) :] + kinds[: r % len(kinds)]:
                c, w, loss = step(kind)
                record[kind] = {"cpu_ms": c, "wall_ms": w, "loss": loss}
                cpu[kind].append(c)
            compare({kind: record[kind]["loss"] for kind in kinds})
            if out is not None:
                out.write(json.dumps(record) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    base = statistics.mean(cpu["autonormal"]) if args.rounds else float("nan")
    summary["identical_losses"] = identical
    if "dvi_compiled" in kinds and "dvi" in kinds:
        summary["compiled_max_rel_diff"] = compiled_diff
    print(f"{args.data}, {args.rounds} interleaved rounds after {args.warmup} steps, 1 thread:")
    for kind in kinds:
        if not cpu[kind]:
            continue
        mean, median = statistics.mean(cpu[kind]), statistics.median(cpu[kind])
        summary[kind] = {"mean": mean, "median": median, "x_autonormal": mean / base}
        print(f"  {kind}: mean {mean:.2f}, median {median:.2f} CPU ms ({mean / base:.2f}x)")
    print(f"  dvi and dvi_before: losses identical at every step: {identical}")
    if "compiled_max_rel_diff" in summary:
        print(f"  dvi_compiled against dvi: largest relative loss difference {compiled_diff:.1e}")
    return summary


if __name__ == "__main__":
    main()
