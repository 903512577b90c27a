r"""UCI regression benchmark: reproduce Table 2 (and the DVI-fixed ablation of Table 4) of Wu et al. (2019).

Usage::

    python recipes/uci_benchmark.py --data-dir ../shared/data/uci \
        --dataset boston,concrete --method dvi,mcvi [--splits K] [--output results.json]

Every split trains a :class:`lightning_dvi.DVIRegressor` with ``lightning.Trainer`` on a
:class:`lightning_dvi.data.UCIDataModule` -- the code path a user runs -- and scores the test
rows: log-likelihood per test point and RMSE, both in the ORIGINAL units of ``y``.

Protocol (paper section 6): one hidden layer of ``n_hidden.txt`` ReLU units (50 when the file is
absent; the shipped protein folder says 100), factorised Gaussian posterior, inputs and targets
standardised with training statistics, the empirical-Bayes inverse-gamma prior
(:math:`\alpha=1, \beta=10`, one prior variance per weight matrix and per bias vector, in-graph),
heteroscedastic likelihood. One set of optimisation hyper-parameters for every dataset (see
``DEFAULTS`` and docs/benchmarks.md for how it was chosen on validation carve-outs of the training
data). Each run is seeded with ``lightning.seed_everything(seed + split)``; the data module's
shuffling uses the same number.

Methods:
* ``dvi``: full activation covariance (``mode="full"``);
* ``ddvi``: diagonal activation covariance (``mode="diag"``);
* ``mcvi``: 10 whole-weight-matrix samples per step (``mode="sample"``, ``num_samples=10``), same
  model and prior; its test predictive is the Monte Carlo mixture over ``--mc-eval-samples``
  weight draws;
* ``hodvi``: DVI with a homoscedastic likelihood (one learned noise variance);
* ``dvi-fixed``: DVI with a fixed ``N(0, v)`` prior on every weight and bias, ``v`` =
  ``--fixed-prior-variance`` (the paper tuned ``v`` per dataset; we use one value for all).

Extra flags beyond the issue's interface (``--max-steps``, ``--validation``, ``--lr`` ...) exist
for the tests and for the hyper-parameter search; their defaults are the committed protocol.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import math
import os
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

# Published figures, Wu et al., "Deterministic Variational Inference for Robust Bayesian Neural
# Networks", ICLR 2019: Table 2 (dvi, ddvi, mcvi, hodvi) and appendix D Table 4 (dvi-fixed),
# test log-likelihood per point, mean and standard error over splits. Reference constants only.
PAPER: dict[str, dict[str, tuple[float, float]]] = {
    "dvi": {
        "boston": (-2.41, 0.02), "concrete": (-3.06, 0.01), "energy": (-1.01, 0.06),
        "kin8nm": (1.13, 0.00), "naval": (6.29, 0.04), "power": (-2.80, 0.00),
        "protein": (-2.85, 0.01), "wine": (-0.90, 0.01), "yacht": (-0.47, 0.03),
    },
    "ddvi": {
        "boston": (-2.42, 0.02), "concrete": (-3.07, 0.02), "energy": (-1.06, 0.06),
        "kin8nm": (1.13, 0.00), "naval": (6.22, 0.06), "power": (-2.80, 0.00),
        "protein": (-2.84, 0.01), "wine": (-0.91, 0.02), "yacht": (-0.47, 0.03),
    },
    "mcvi": {
        "boston": (-2.46, 0.02), "concrete": (-3.07, 0.01), "energy": (-1.03, 0.04),
        "kin8nm": (1.14, 0.00), "naval": (5.94, 0.05), "power": (-2.80, 0.00),
        "protein": (-2.87, 0.01), "wine": (-0.92, 0.01), "yacht": (-0.68, 0.03),
    },
    "hodvi": {
        "boston": (-2.58, 0.04), "concrete": (-3.23, 0.01), "energy": (-2.09, 0.06),
        "kin8nm": (1.01, 0.01), "naval": (5.84, 0.06), "power": (-2.82, 0.00),
        "protein": (-2.94, 0.00), "wine": (-0.96, 0.01), "yacht": (-1.41, 0.03),
    },
    "dvi-fixed": {
        "boston": (-2.46, 0.02), "concrete": (-3.07, 0.01), "energy": (-1.07, 0.04),
        "kin8nm": (1.12, 0.00), "naval": (6.32, 0.04), "power": (-2.80, 0.01),
        "protein": (-2.84, 0.01), "wine": (-0.94, 0.01), "yacht": (-0.49, 0.03),
    },
}  # fmt: skip

METHODS: dict[str, dict[str, Any]] = {
    "dvi": {"mode": "full", "likelihood": "heteroscedastic", "prior": "empirical_bayes"},
    "ddvi": {"mode": "diag", "likelihood": "heteroscedastic", "prior": "empirical_bayes"},
    "mcvi": {
        "mode": "sample",
        "num_samples": 10,
        "likelihood": "heteroscedastic",
        "prior": "empirical_bayes",
    },
    "hodvi": {"mode": "full", "likelihood": "homoscedastic", "prior": "empirical_bayes"},
    "dvi-fixed": {"mode": "full", "likelihood": "heteroscedastic", "prior": "gaussian"},
}


@dataclass(frozen=True)
class Settings:
    """Optimisation hyper-parameters, shared by every dataset and method.

    The number of steps is ``clip(epochs * ceil(N / batch_size), min_steps, max_steps)`` with
    ``N`` the training rows, so small datasets still get enough updates and the largest stay
    within the runtime budget. Adam with a cosine decay of the learning rate to
    ``final_lr_fraction * lr`` over those steps (``DVIRegressor(lr_schedule="cosine")``). The KL
    weight is 0 for the first ``kl_warmup`` fraction of the steps, then ramps linearly to 1 over
    the next ``kl_anneal`` fraction and stays at 1: the remaining steps optimise the ELBO itself.
    Gradients are clipped to norm ``grad_clip`` (``Trainer(gradient_clip_val=...)``; 0 = off).
    See docs/benchmarks.md for how these values were chosen on validation carve-outs.
    """

    lr: float = 2e-2
    batch_size: int = 64
    epochs: float = 60.0
    min_steps: int = 8000
    max_steps: int = 10000
    final_lr_fraction: float = 0.01
    kl_warmup: float = 0.5
    kl_anneal: float = 0.1
    grad_clip: float = 5.0
    init_log_noise: float = -3.0
    fixed_prior_variance: float = 1.0
    mc_eval_samples: int = 100
    seed: int = 0


DEFAULTS = Settings()


def num_steps(num_train: int, settings: Settings) -> int:
    """Optimisation steps for a training set of ``num_train`` rows (see :class:`Settings`)."""
    per_epoch = math.ceil(num_train / settings.batch_size)
    steps = math.ceil(settings.epochs * per_epoch)
    return int(min(max(steps, settings.min_steps), settings.max_steps))


# --------------------------------------------------------------------------- dataset discovery
def _dataset_folder(data_dir: Path, name: str) -> Path:
    folder = data_dir / name
    if not folder.is_dir():
        available = sorted(p.name for p in data_dir.iterdir() if p.is_dir())
        raise ValueError(
            f"unknown dataset {name!r}: no folder {folder} (datasets in {data_dir}: "
            f"{', '.join(available) or 'none'})"
        )
    for required in ("data.txt", "index_features.txt", "index_target.txt"):
        if not (folder / required).is_file():
            raise ValueError(f"dataset {name!r} is not in the standard layout: missing {required}")
    return folder


def hidden_width(folder: Path) -> int:
    """``n_hidden.txt`` if present (the protocol's width: 100 for protein), else 50."""
    path = folder / "n_hidden.txt"
    if path.is_file():
        text = path.read_text().split()
        if len(text) == 1 and text[0].isdigit() and int(text[0]) > 0:
            return int(text[0])
        raise ValueError(f"{path} must hold one positive integer, got {' '.join(text)!r}")
    return 50


def _split_list(text: str, what: str, allowed: list[str] | None = None) -> list[str]:
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError(f"--{what} needs at least one name")
    if allowed is not None:
        unknown = [n for n in names if n not in allowed]
        if unknown:
            raise ValueError(f"unknown {what} {unknown[0]!r}; choose from {', '.join(allowed)}")
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------- one run
@dataclass(frozen=True)
class Job:
    """One (dataset, method, split) training run."""

    data_dir: str
    dataset: str
    method: str
    split: int
    hidden: int
    validation: float
    steps_cap: int | None
    settings: Settings


def run_job(job: Job) -> dict[str, Any]:
    """Train one split and score it; returns ``{"split", "test_ll", "rmse", "seconds", ...}``."""
    import torch

    torch.set_num_threads(1)
    import lightning

    from lightning_dvi import DVIRegressor
    from lightning_dvi.data import UCIDataModule

    # Lightning's per-run banners and hints would bury the per-split lines of 105 runs.
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", ".*does not have many workers.*")
    warnings.filterwarnings("ignore", ".*number of training batches.*")
    warnings.filterwarnings("ignore", ".*LeafSpec.*")
    start = time.perf_counter()
    s, spec = job.settings, METHODS[job.method]
    seed = s.seed + job.split
    lightning.seed_everything(seed, workers=True, verbose=False)
    dm = UCIDataModule(
        job.data_dir,
        job.dataset,
        split=job.split,
        val_fraction=job.validation,
        batch_size=s.batch_size,
        seed=seed,
    )
    dm.setup("fit")
    steps = num_steps(dm.num_train, s)
    if job.steps_cap is not None:
        steps = min(steps, job.steps_cap)
    model = DVIRegressor(
        in_features=dm.in_features,
        hidden=[job.hidden],
        mode=spec["mode"],
        num_samples=spec.get("num_samples"),
        likelihood=spec["likelihood"],
        prior=spec["prior"],
        prior_alpha=1.0,
        prior_beta=10.0,
        prior_variance=s.fixed_prior_variance,
        lr=s.lr,
        lr_schedule="cosine",
        min_lr=s.lr * s.final_lr_fraction,
        kl_warmup_steps=round(s.kl_warmup * steps),
        kl_anneal_steps=round(s.kl_anneal * steps),
        init_log_noise=s.init_log_noise,
        num_data=dm.num_train,
    )
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        max_epochs=-1,
        limit_val_batches=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
        num_sanity_val_steps=0,
        # Nothing reads logged values here; each LightningModule.log call costs ~0.5 ms on CPU,
        # a large share of a step of these small networks, and DVIModule skips them on steps
        # whose values would not be written.
        log_every_n_steps=steps + 1,
        gradient_clip_val=s.grad_clip or None,
        deterministic=False,
    )
    trainer.fit(model, datamodule=dm)
    held_out = dm.val_dataset if job.validation > 0 else dm.test_dataset
    assert held_out is not None
    test_ll, rmse = score(model, *held_out.tensors, s.mc_eval_samples)
    return {
        "split": job.split,
        "test_ll": test_ll,
        "rmse": rmse,
        "seconds": time.perf_counter() - start,
        "steps": steps,
    }


def score(model: Any, x: Any, y: Any, mc_eval_samples: int) -> tuple[float, float]:
    r"""Mean log-likelihood per point and RMSE, both in the original units of ``y``.

    ``y`` is in its original units (as the data module yields it). ``full``/``diag``: the
    model's closed-form Gaussian predictive. ``sample``: the Monte Carlo predictive mixture
    :math:`\\log\\frac1S\\sum_s p(y\\mid x, w_s)` over ``mc_eval_samples`` weight draws (the
    usual MCVI evaluation), RMSE of the mixture mean.
    """
    import torch

    model.eval()
    scale, loc = float(model.target_scale), float(model.target_loc)
    y = y.double()
    y_std = ((y - loc) / scale).to(x.dtype)
    with torch.no_grad():
        if model.mode in ("sample", "local"):
            f = model.net(x, mode=model.mode, num_samples=mc_eval_samples).double()
            # the mixture density, standardised units -> original units (- log scale)
            ll = model.likelihood.mixture_log_prob(f, y_std.double()) - math.log(scale)
            mean = f[..., 0].double().mean(0) * scale + loc
        else:
            mean, var = model.predictive(x)
            mean, var = mean.double(), var.double()
            ll = torch.distributions.Normal(mean, var.sqrt()).log_prob(y)
    rmse = float((mean - y).square().mean().sqrt())
    return float(ll.mean()), rmse


# --------------------------------------------------------------------------- aggregation / report
def summarise(dataset: str, method: str, splits: list[dict[str, Any]]) -> dict[str, Any]:
    """One JSON result row: means and standard errors (std / sqrt(n), ``ddof=0``) over splits."""
    splits = sorted(splits, key=lambda r: r["split"])
    ll = np.array([r["test_ll"] for r in splits])
    rmse = np.array([r["rmse"] for r in splits])
    n = len(splits)
    return {
        "dataset": dataset,
        "method": method,
        "test_ll_mean": float(ll.mean()),
        "test_ll_stderr": float(ll.std() / math.sqrt(n)),
        "rmse_mean": float(rmse.mean()),
        "rmse_stderr": float(rmse.std() / math.sqrt(n)),
        "seconds": float(sum(r["seconds"] for r in splits)),
        "splits": [
            {k: r[k] for k in ("split", "test_ll", "rmse", "seconds", "steps")} for r in splits
        ],
    }


def markdown_table(results: list[dict[str, Any]]) -> str:
    """Ours beside the paper's figure (Table 2; Table 4 for dvi-fixed), one row per result."""
    lines = [
        "| dataset | method | splits | test LL (ours) | test LL (paper) | RMSE (ours) | seconds |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        paper = PAPER.get(r["method"], {}).get(r["dataset"])
        paper_text = "n/a" if paper is None else f"{paper[0]:.2f} ± {paper[1]:.2f}"
        lines.append(
            f"| {r['dataset']} | {r['method']} | {len(r['splits'])} | "
            f"{r['test_ll_mean']:.3f} ± {r['test_ll_stderr']:.3f} | {paper_text} | "
            f"{r['rmse_mean']:.3f} ± {r['rmse_stderr']:.3f} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", required=True, help="directory with one folder per dataset")
    p.add_argument("--dataset", required=True, help="comma-separated dataset folder names")
    p.add_argument("--method", required=True, help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--splits", type=int, default=None, help="run the first K splits (default all)")
    p.add_argument("--output", default=None, help="write the results JSON here")
    p.add_argument("--workers", type=int, default=2, help="parallel processes (1 thread each)")
    p.add_argument("--max-steps", type=int, default=None, help="cap steps per run (smoke tests)")
    p.add_argument(
        "--validation",
        type=float,
        default=0.0,
        help="score on this fraction of the TRAINING split held out (hyper-parameter search); "
        "0 scores on the test split",
    )
    for field in ("lr", "batch_size", "epochs", "min_steps", "max_steps_budget", "final_lr_fraction",
                  "kl_warmup", "kl_anneal", "grad_clip", "fixed_prior_variance", "mc_eval_samples", "seed",
                  "init_log_noise"):  # fmt: skip
        name = "max_steps" if field == "max_steps_budget" else field
        default = getattr(DEFAULTS, name)
        p.add_argument(
            "--" + field.replace("_", "-"),
            type=type(default),
            default=default,
            dest=field,
            help=f"(default {default})",
        )
    return p


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[Job]]:
    """Parse and validate the command line; returns the arguments and the jobs to run.

    Raises:
        ValueError: for an unknown method or dataset, a bad ``--splits`` or other bad values.
    """
    args = build_parser().parse_args(argv)
    data_dir = Path(args.data_dir).expanduser()
    if not data_dir.is_dir():
        raise ValueError(f"--data-dir {data_dir} is not a directory")
    methods = _split_list(args.method, "method", list(METHODS))
    datasets = _split_list(args.dataset, "dataset")
    if args.splits is not None and args.splits < 1:
        raise ValueError(f"--splits must be >= 1, got {args.splits}")
    if args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    if args.max_steps is not None and args.max_steps < 1:
        raise ValueError(f"--max-steps must be >= 1, got {args.max_steps}")
    warm, ramp = args.kl_warmup, args.kl_anneal
    if min(warm, ramp) < 0.0 or warm + ramp > 1.0:
        raise ValueError(
            f"--kl-warmup and --kl-anneal are fractions of the steps, >= 0 with a sum <= 1; got "
            f"{args.kl_warmup} and {args.kl_anneal}"
        )
    if not 0.0 <= args.validation < 1.0:
        raise ValueError(f"--validation must lie in [0, 1), got {args.validation}")
    if not args.grad_clip >= 0.0:
        raise ValueError(f"--grad-clip must be >= 0 (0 = no clipping), got {args.grad_clip}")
    settings = Settings(
        lr=args.lr,
        batch_size=args.batch_size,
        epochs=args.epochs,
        min_steps=args.min_steps,
        max_steps=args.max_steps_budget,
        final_lr_fraction=args.final_lr_fraction,
        kl_warmup=args.kl_warmup,
        kl_anneal=args.kl_anneal,
        grad_clip=args.grad_clip,
        init_log_noise=args.init_log_noise,
        fixed_prior_variance=args.fixed_prior_variance,
        mc_eval_samples=args.mc_eval_samples,
        seed=args.seed,
    )
    from lightning_dvi.data.uci import count_uci_splits

    jobs = []
    for dataset in datasets:
        folder = _dataset_folder(data_dir, dataset)
        available = count_uci_splits(folder)
        k = available if args.splits is None else args.splits
        if k > available:
            raise ValueError(f"--splits {k}: {dataset} has only {available} splits")
        hidden = hidden_width(folder)
        for method in methods:
            jobs += [
                Job(
                    str(data_dir),
                    dataset,
                    method,
                    split,
                    hidden,
                    args.validation,
                    args.max_steps,
                    settings,
                )
                for split in range(k)
            ]
    return args, jobs


def run(jobs: list[Job], workers: int) -> list[dict[str, Any]]:
    """Run the jobs (largest training sets first, for load balance) and aggregate per (dataset, method)."""
    outcomes: dict[tuple[str, str], list[dict[str, Any]]] = {}
    order = sorted(range(len(jobs)), key=lambda i: -_cost(jobs[i]))

    def record(job: Job, result: dict[str, Any]) -> None:
        print(
            f"{job.dataset:>10} {job.method:>9} split {job.split:>2}: test LL "
            f"{result['test_ll']:8.4f}  RMSE {result['rmse']:8.4f}  "
            f"{result['steps']} steps  {result['seconds']:6.1f} s",
            file=sys.stderr,
            flush=True,
        )
        outcomes.setdefault((job.dataset, job.method), []).append(result)

    if workers == 1:
        for i in order:
            record(jobs[i], run_job(jobs[i]))
    else:
        # spawn: a clean interpreter per worker (forking after torch started threads can hang).
        with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as pool:
            futures = {pool.submit(run_job, jobs[i]): jobs[i] for i in order}
            for future in as_completed(futures):
                record(futures[future], future.result())
    keys = [(j.dataset, j.method) for j in jobs]
    return [summarise(d, m, outcomes[(d, m)]) for d, m in dict.fromkeys(keys)]


@functools.cache
def _rows(data_dir: str, dataset: str) -> int:
    with open(Path(data_dir) / dataset / "data.txt") as f:
        return sum(1 for _ in f)


def _cost(job: Job) -> float:
    return _rows(job.data_dir, job.dataset) * job.hidden * (10 if job.method == "mcvi" else 1)


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse, run, print the markdown table, write the JSON."""
    try:
        args, jobs = parse_args(argv)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    start = time.perf_counter()
    results = run(jobs, args.workers)
    wall = time.perf_counter() - start
    print(markdown_table(results))
    print(f"\n{len(jobs)} runs, wall time {wall:.0f} s", flush=True)
    if args.output:
        payload = {
            "results": results,
            "wall_seconds": wall,
            "settings": asdict(jobs[0].settings) if jobs else {},
            "validation_fraction": args.validation,
            "max_steps_cap": args.max_steps,
        }
        Path(args.output).write_text(json.dumps(payload, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
