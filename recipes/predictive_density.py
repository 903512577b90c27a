r"""The same UCI fits scored by the exact heteroscedastic predictive and by the Gaussian of its moments.

Usage::

    python recipes/predictive_density.py --data-dir ../shared/data/uci --dataset energy \
        --candidates paired-trim1-kept,adam8000 --splits 10 --output density.jsonl

Each (candidate, split) is one :func:`lightning_dvi_benchmarks.uci.run_job`, the user's code
path, seed 0. Its restored fit is scored on the test rows twice:

- ``test_ll``: the runner's score, the exact density of
  :class:`~lightning_dvi.likelihoods.HeteroscedasticPredictive` (``predictive_log_prob``);
- ``gaussian_ll``: the Gaussian with the same mean and variance, as the paper and the runner
  before ``1b6f552`` scored it.

It also records each fit's median log-noise variance :math:`\Sigma_{\ell\ell}` on the test
rows. Candidates: :data:`~lightning_dvi_benchmarks.uci_leave_one_out.CANDIDATES` and
``adam8000``. One JSON line per run goes to ``--output`` (a rerun skips what is there); then
a table of means per candidate. ``--steps-cap`` caps the optimisation steps (for tests).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from lightning_dvi.likelihoods import HeteroscedasticGaussian
from lightning_dvi_benchmarks.uci import PRESETS, make_jobs, run_job
from lightning_dvi_benchmarks.uci_leave_one_out import CANDIDATES


def both_scores(model: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """The moments' Gaussian log-likelihood and the median log-noise variance on ``(x, y)``."""
    model.eval()
    with torch.no_grad():
        mean, var = model.predictive(x)
        gaussian = torch.distributions.Normal(mean, var.sqrt()).log_prob(y.double())
        out = model.net(x, mode=model.propagation.closed_form())
        var_l = HeteroscedasticGaussian._parts(out)[3]
    return {"gaussian_ll": float(gaussian.mean()), "median_var_l": float(var_l.median())}


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--candidates", default="paired-trim1-kept,adam8000", help="comma-separated")
    p.add_argument("--splits", type=int, default=10, help="splits 0..K-1")
    p.add_argument("--steps-cap", type=int, default=None)
    p.add_argument("--output", required=True, help="JSON-lines file (appended to)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the fits not yet in ``--output``, then print the means; returns the exit status."""
    args = build_parser().parse_args(argv)
    settings = {**CANDIDATES, "adam8000": PRESETS["adam8000"]}
    names = [c.strip() for c in args.candidates.split(",") if c.strip()]
    unknown = [c for c in names if c not in settings]
    if unknown:
        raise SystemExit(f"unknown candidate {unknown[0]!r}; choose from {', '.join(settings)}")
    out = Path(args.output)
    done = set()
    if out.exists():
        records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
        done = {(r["candidate"], r["dataset"], r["split"]) for r in records}
    for name in names:
        jobs = make_jobs(
            Path(args.data_dir), [args.dataset], ["dvi"], settings[name], args.splits,
            steps_cap=args.steps_cap,
        )  # fmt: skip
        for job in jobs:
            if (name, job.dataset, job.split) in done:
                continue
            result = run_job(job, extra_scores=both_scores)
            line = {"candidate": name, "dataset": job.dataset, **result}
            with out.open("a") as f:
                f.write(json.dumps(line) + "\n")
            print(
                f"{name:>18} {job.dataset} split {job.split:2d}: exact {result['test_ll']:.4f}"
                f"  gaussian {result['gaussian_ll']:.4f}  median var_l "
                f"{result['median_var_l']:.4f}",
                flush=True,
            )
    records = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    print("| candidate | splits | exact density | Gaussian of the moments | median Σ_ℓℓ |")
    print("|---|---|---|---|---|")
    for name in names:
        rows = [r for r in records if r["candidate"] == name and r["dataset"] == args.dataset]
        if not rows:
            continue
        k = len(rows)
        exact = sum(r["test_ll"] for r in rows) / k
        gauss = sum(r["gaussian_ll"] for r in rows) / k
        spread = sorted(r["median_var_l"] for r in rows)[k // 2]
        print(f"| {name} | {k} | {exact:.3f} | {gauss:.3f} | {spread:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
