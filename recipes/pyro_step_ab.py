"""One SVI step of AutoNormal against DeterministicGuide, with and without the same-shape rule.

The A/B of the Pyro step-cost change of issue 39 (item 3): in one process, from the same seed,
three runs on the Pyro tutorial classifier of ``recipes/pyro_classifier_swap.py`` (full batch):

* ``autonormal``: ``AutoNormal`` + ``Trace_ELBO``;
* ``dvi``: ``DeterministicGuide`` + ``DeterministicELBO`` as the library runs it;
* ``dvi_before``: the same with the moment rule for shape ops that move no element switched off
  (``lightning_dvi.pyro.moment_rules._IDENTITY_IF_SAME_SHAPE`` emptied for its steps), so that
  the plate's ``dist.expand`` gathers the head's ``[N, K, K]`` covariance as before the change.

Each run takes ``--warmup`` ``pyro.optim.Adam({"lr": 1e-2})`` steps (the first from the same
seed), then ``--rounds`` rounds of one step of each, in rotating order, timed by CPU
(``time.process_time``) and wall clock. One JSON line per round goes to ``--json`` (appended,
written as it goes), with each run's loss: the two deterministic runs must report the same loss
at every step. One torch thread.

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

from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide, moment_rules

RUNS = ("autonormal", "dvi", "dvi_before")


def main(argv: list[str] | None = None) -> dict:
    """Run the rounds; print and return the mean and median CPU ms per step of each run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("digits", "cancer", "parity"), default="digits")
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="append one JSON line per round here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    x, y, _, _ = load(args.data, args.seed)
    classes = int(y.max()) + 1
    pyro.clear_param_store()
    same_shape_rule = moment_rules._IDENTITY_IF_SAME_SHAPE
    runs: dict[str, SVI] = {}
    for kind in RUNS:
        model = Classifier(x.shape[1], classes, "categorical")
        if kind == "autonormal":
            guide = type("AutoNormal_step_ab", (AutoNormal,), {})(model)
            runs[kind] = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), Trace_ELBO())
        else:
            guide = DeterministicGuide(model, name=f"DeterministicGuide_{kind}")
            runs[kind] = SVI(model, guide, pyro.optim.Adam({"lr": 1e-2}), DeterministicELBO())

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

    identical = True
    for kind in RUNS:  # the first step creates each guide's parameters: from the same seed
        pyro.set_rng_seed(args.seed)
        step(kind)
    for _ in range(args.warmup - 1):
        losses = {kind: step(kind)[2] for kind in RUNS}
        identical &= losses["dvi"] == losses["dvi_before"]
    out = open(args.json, "a") if args.json else None  # noqa: SIM115 - closed below
    cpu: dict[str, list[float]] = {kind: [] for kind in RUNS}
    try:
        for r in range(args.rounds):
            record: dict = {"round": r, "load": os.getloadavg()[0], "data": args.data}
            for kind in RUNS[r % 3 :] + RUNS[: r % 3]:
                c, w, loss = step(kind)
                record[kind] = {"cpu_ms": c, "wall_ms": w, "loss": loss}
                cpu[kind].append(c)
            record["identical_loss"] = record["dvi"]["loss"] == record["dvi_before"]["loss"]
            identical &= record["identical_loss"]
            if out is not None:
                out.write(json.dumps(record) + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    base = statistics.mean(cpu["autonormal"]) if args.rounds else float("nan")
    summary: dict = {"identical_losses": identical}
    print(f"{args.data}, {args.rounds} interleaved rounds after {args.warmup} steps, 1 thread:")
    for kind in RUNS:
        if not cpu[kind]:
            continue
        mean, median = statistics.mean(cpu[kind]), statistics.median(cpu[kind])
        summary[kind] = {"mean": mean, "median": median, "x_autonormal": mean / base}
        print(f"  {kind}: mean {mean:.2f}, median {median:.2f} CPU ms ({mean / base:.2f}x)")
    print(f"  the two deterministic runs' losses identical at every step: {identical}")
    return summary


if __name__ == "__main__":
    main()
