r"""Replay a ``--protocol validation`` run of the swap recipe and re-evaluate its restored states.

``recipes/pyro_classifier_swap.py --protocol validation --json PATH`` records each guide's best
step. This recipe rebuilds that run (same seed, same build order; the deterministic guide draws
random numbers only for its initial means, and the validation evaluations draw from a forked
generator, so AutoNormal's training draws are the run's own), steps each guide to its recorded
best step, checks the replay by the validation NLL there (it must equal the recorded
``best_val_nll``), and evaluates the test NLL with ``--repeats`` independent sets of
``--draws`` vectorised weight draws: the spread of the recorded ``--final-draws`` figure, and a
value with more draws.

Run:  .venv/bin/python recipes/pyro_validation_replay.py --data parity --likelihood bernoulli \
          --seed 0 --runs validation.jsonl --json replay.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import pyro
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling recipe's model and data
import pyro_classifier_swap as swap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Replay one recorded run; print and return the per-guide re-evaluation."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", choices=("digits", "cancer", "parity"), default="parity")
    parser.add_argument("--likelihood", choices=("categorical", "bernoulli"), default="bernoulli")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--runs", required=True, help="the swap recipe's --json file")
    parser.add_argument("--draws", type=int, default=40000)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--json", default=None, help="append the result as a JSON line here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    key = (args.data, args.likelihood, args.seed)
    recorded: dict[str, dict[str, Any]] = {}
    for line in Path(args.runs).read_text().splitlines():
        row = json.loads(line)
        if (row["data"], row["likelihood"], row["seed"]) == key and "best_step" in row:
            recorded[row["guide"]] = row  # the last matching run counts
    first = next(iter(recorded.values()))
    options = ["--data", args.data, "--likelihood", args.likelihood, "--seed", str(args.seed)]
    options += ["--lr", str(first["lr"]), "--protocol", "validation"]
    run = swap.make_parser().parse_args(options)
    x, y, x_te, y_te = swap.load(args.data, args.seed)
    run.classes = int(y.max()) + 1
    y_obs = y.float() if args.likelihood == "bernoulli" else y
    pyro.clear_param_store()
    pyro.set_rng_seed(args.seed)
    kinds = [k for k in ("dvi", "autonormal") if k in recorded]  # the recipe's build order
    runs = {kind: swap.build(run, kind, x) for kind in kinds}
    x_fit, y_fit, x_val, y_val = swap.split_validation(x, y_obs, first["val_fraction"], args.seed)
    stop = {kind: recorded[kind]["best_step"] for kind in kinds}
    for step in range(1, max(stop.values()) + 1):
        for kind, (_, _, svi) in runs.items():
            if step <= stop[kind]:
                svi.step(x_fit, y_fit)
    result: dict[str, Any] = {"data": args.data, "likelihood": args.likelihood}
    result.update(seed=args.seed, draws=args.draws)
    for kind, (model, guide, _) in runs.items():
        val = swap.predictive_nll(
            model, guide, x_val, y_val, num_samples=first["val_draws"], seed=args.seed
        )
        nlls = []
        for r in range(args.repeats):
            torch.manual_seed(1000 + r)
            probs = swap.vectorised_probs(guide, x_te, args.likelihood, args.draws)
            nlls.append(swap.nll_of(probs, y_te))
        result[kind] = {
            "best_step": stop[kind],
            "val_nll": val,
            "recorded_val_nll": recorded[kind]["best_val_nll"],
            "recorded_nll": recorded[kind]["nll"],
            "nll": nlls,
        }
        print(
            f"{kind}: step {stop[kind]}, validation NLL {val:.5f} (recorded "
            f"{recorded[kind]['best_val_nll']:.5f}), test NLL from {args.draws} draws "
            f"{', '.join(f'{v:.4f}' for v in nlls)} (recorded {recorded[kind]['nll']:.4f})",
            flush=True,
        )
    if args.json:
        with open(args.json, "a") as out:
            out.write(json.dumps(result) + "\n")
    return result


if __name__ == "__main__":
    main()
