r"""Per-ELBO-step trace of the default UCI protocol: carve-out and test log-likelihoods, row by row.

Usage::

    python recipes/uci_step_trace.py --data-dir ../shared/data/uci --datasets energy \
        --splits 5 --patience 80 --output trace.jsonl

Runs :func:`lightning_dvi_benchmarks.uci.run_job` with the default settings (seed 0), except
that :class:`~lightning_dvi.callbacks.PairedEarlyStopping` waits ``--patience`` validations
without a new best before it stops (the warm start keeps its own patience), and records after
every L-BFGS step of the ELBO phase: the per-row log predictive densities of the carve-out
(what the stopping rule sees) and of the test rows (what it is scored on; never read by the
rule), and the CPU seconds so far without the recording's own test pass. One JSON line per
(data set, split): ``{"dataset", "split", "patience", "result", "cpu_total", "steps": [{"cpu",
"val", "test"}, ...]}``. Since the rule only stops and restores, any stopping rule with less
patience can be replayed on the trace (issue 45: why the carve-out of energy split 5 picks step
13). Reruns skip the (data set, split) pairs already in ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

import lightning_dvi.callbacks as callbacks
from lightning_dvi_benchmarks import uci


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--datasets", required=True, help="comma-separated")
    p.add_argument("--splits", default="0", help="comma-separated split indices")
    p.add_argument("--patience", type=int, default=15, help="ELBO-phase patience while tracing")
    p.add_argument("--output", required=True, help="JSON-lines file (appended to)")
    return p


def _tracer(patience: int, state: dict[str, Any]) -> type[callbacks.PairedEarlyStopping]:
    class Trace(callbacks.PairedEarlyStopping):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.patience = patience

        def on_validation_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            start = time.process_time()
            rows = torch.cat(self._rows)
            x, y = trainer.datamodule.test_dataset.tensors[:2]
            was_training = pl_module.training
            pl_module.eval()
            dtype = next(pl_module.parameters()).dtype
            test = pl_module.predictive_log_prob(x.to(dtype), y).double()
            pl_module.train(was_training)
            state["overhead"] += time.process_time() - start
            super().on_validation_epoch_end(trainer, pl_module)
            cpu = time.process_time() - state["cpu0"] - state["overhead"]
            state["steps"].append({"cpu": cpu, "val": [round(v, 5) for v in rows.tolist()],
                                   "test": [round(v, 5) for v in test.tolist()]})  # fmt: skip

    return Trace


def main(argv: list[str] | None = None) -> int:
    """Trace every (data set, split) not yet in ``--output``; returns the exit status."""
    args = build_parser().parse_args(argv)
    out_path, data = Path(args.output), Path(args.data_dir)
    done = set()
    if out_path.is_file():
        for line in out_path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            done.add((r["dataset"], r["split"]))
    state: dict[str, Any] = {}
    original = callbacks.PairedEarlyStopping
    callbacks.PairedEarlyStopping = _tracer(args.patience, state)  # type: ignore[misc]
    try:
        with out_path.open("a") as out:
            for name in [s for s in args.datasets.split(",") if s]:
                hidden = uci.hidden_width(uci.dataset_folder(data, name))
                for split in [int(s) for s in args.splits.split(",") if s]:
                    if (name, split) in done:
                        continue
                    state.update(overhead=0.0, steps=[], cpu0=time.process_time())
                    settings = replace(uci.DEFAULTS, seed=0)
                    job = uci.Job(str(data), name, "dvi", split, hidden, 0.0, None, settings)
                    result = uci.run_job(job)
                    total = time.process_time() - state["cpu0"] - state["overhead"]
                    out.write(json.dumps({"dataset": name, "split": split,
                                          "patience": args.patience, "result": result,
                                          "cpu_total": total, "steps": state["steps"]}) + "\n")  # fmt: skip
                    out.flush()
                    print(f"{name} split {split}: {len(state['steps'])} ELBO steps, "
                          f"{total:.1f} CPU s", flush=True)  # fmt: skip
    finally:
        callbacks.PairedEarlyStopping = original  # type: ignore[misc]
    return 0


if __name__ == "__main__":
    sys.exit(main())
