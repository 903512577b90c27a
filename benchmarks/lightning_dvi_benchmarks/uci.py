r"""The UCI regression benchmark's runner: one (dataset, method, split) per job, many per process.

Every job trains a :class:`lightning_dvi.DVIRegressor` with ``lightning.Trainer`` on a
:class:`lightning_dvi.data.UCIDataModule` (the code path a user runs) and scores the test rows:
log-likelihood per point and RMSE in the original units of ``y``, plus the job's wall and CPU
seconds (``time.process_time`` of the worker, one thread, Trainer and data set-up included,
process start-up not).

Protocols (:data:`PRESETS`):

* ``"lbfgs"`` (the default): first the point-estimate warm start
  (:class:`~lightning_dvi.callbacks.PointEstimateWarmStart`, ``warm_start="point"``: the
  posterior means fitted as a plain network by full-batch L-BFGS on the squared error of the
  mean, early-stopped with ``patience`` on the carve-out below; fitting the data before the KL
  acts, which L-BFGS on the ELBO from a random start does not do); then full-batch L-BFGS with
  a strong-Wolfe line search (``DVIRegressor(optimizer="lbfgs")``, ``lbfgs_iterations`` per
  step) on the full ELBO, early stopping on a seeded carve-out of ``early_stopping_fraction`` of
  the training rows: validation NLL after every step, stop after ``patience`` steps without
  improvement (5: chosen on UCI splits 5-9, which issue 31's acceptance does not use; see
  docs/benchmarks.md), at most ``max_steps`` steps. The step restored is chosen per run
  (issue 45, :class:`~lightning_dvi.callbacks.PairedEarlyStopping`, ``z=0.5, skip=3,
  trim=1, patience_on="kept"``): the last step whose per-row carve-out log-likelihoods are
  not worse than the best step's by more than half a standard error of their paired
  difference (the largest and smallest difference set aside), the first three ELBO steps never
  being the reference best; the run stops after ``patience`` steps in a row each shown worse
  than that; chosen leave-one-data-set-out (docs/uci_protocol.md, fourth pass).
  ``precision`` is the Trainer's (``"64-true"`` trains in float64). The targets are
  dequantised at their decimal grid (``target_resolution="auto"``,
  :func:`~lightning_dvi.lightning.regressor.target_grid_step`: wine's integer quality scores
  made the noise collapse on splits 7 and 8, test LL -12 and -77, docs/benchmarks.md);
  ``target_resolution="none"`` turns it off, a number sets the step in the targets' units.

  **Large tables** (the rule, read from the data in hand: a training set of more than
  ``large_rows`` rows, 5,000, i.e. at least five mini-batches of ``large_batch_size``; UCI
  power and protein, none of the four small sets): a full-batch evaluation then costs N times
  what it costs on a small table while the L-BFGS run needs as many steps, so the split's
  time grows with N times the steps (protein: 210 CPU s). Instead (:func:`_run_large`):
  the warm start and at most ``large_subsample_steps`` (20) L-BFGS steps on the ELBO run on
  ``large_subsample`` (4,096) seeded random training rows as one batch (``num_data`` still
  the full training set's, so the KL weighs as on every row), early-stopped on the carve-out
  as above; then Adam on mini-batches of ``large_batch_size`` (1,024) of every training row
  for ``large_epochs`` (16) epochs, learning rate ``large_lr`` (0.01) decayed by a cosine to
  ``large_final_lr_fraction`` (0.1) of it, the KL at full weight. Its cost is a fixed number
  of subsample steps plus a fixed number of epochs: linear in N (docs/uci_large.md).
  ``large_rows=0`` (``"lbfgs-full-batch"``) runs the full-batch protocol at every size.
* ``"lbfgs-full-batch"``: the default without the large-table rule (the default until
  issue 39's fourth item). Its ``"kept"`` patience runs long on a large carve-out: 1.8x the
  CPU of the pre-issue-45 rule on power (861 carve-out rows; docs/uci_protocol.md, third
  pass).
* ``"lbfgs-best"``: the same (full batch at every size), restoring the step of the best mean validation NLL
  (:class:`~lightning_dvi.callbacks.RestoreBestWeights`; the default until issue 45).
* ``"lbfgs-adam"``: the same, with ``warm_start="adam"`` (the protocol of issue 31's second to
  sixth passes): on training sets of at most ``adam_max_rows`` rows, ``adam_steps`` full-batch
  Adam steps (learning rate ``lr``, the KL off for the first ``kl_warmup`` of them and ramped in
  over the next ``kl_anneal``) instead of the point estimate; larger sets go to L-BFGS directly.
  It under-fits UCI energy (docs/benchmarks.md, sixth pass).
* ``"adam8000"``: the protocol of the paper-reproduction table (until issue 31 the default):
  Adam on minibatches of 64 with a cosine learning-rate decay, ``clip(epochs * ceil(N / 64),
  min_steps, max_steps)`` steps (8000 on the small sets), the KL off for the first half and
  ramped in over the next tenth, gradients clipped to norm 5, no early stopping.

Monte Carlo methods (``mcvi``) cannot use L-BFGS (their objective is random) and always run
``"adam8000"``.
"""

from __future__ import annotations

import functools
import logging
import math
import time
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Literal

from .tables import summarise

__all__ = [
    "DEFAULTS",
    "METHODS",
    "PAPER",
    "PRESETS",
    "Job",
    "Settings",
    "dataset_folder",
    "hidden_width",
    "make_jobs",
    "num_steps",
    "run",
    "run_job",
    "score",
]

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
    """Optimisation hyper-parameters, shared by every dataset and method (see the module docstring).

    ``optimizer="lbfgs"`` uses ``lbfgs_iterations``, ``lbfgs_history``, ``max_steps`` (L-BFGS
    steps), ``early_stopping_fraction``, ``patience`` and ``warm_start``: ``"point"`` (the
    point-estimate fit of the means, :class:`~lightning_dvi.callbacks.PointEstimateWarmStart`,
    with ``patience``), ``"adam"`` (an Adam phase of ``adam_steps`` steps on training sets of
    at most ``adam_max_rows`` rows, with ``lr``, ``kl_warmup`` and ``kl_anneal`` as fractions
    of it) or ``"none"``; ``optimizer="adam"`` uses ``lr``,
    ``batch_size``, ``epochs``, ``min_steps``, ``max_steps``, ``final_lr_fraction``,
    ``kl_warmup``, ``kl_anneal`` and ``grad_clip`` (and early stopping when
    ``early_stopping_fraction > 0``). The rest serve both.

    Which early-stopped step is restored (``selection``): ``"best"``, the best mean validation
    NLL (Lightning's ``EarlyStopping`` with :class:`~lightning_dvi.callbacks.RestoreBestWeights`);
    ``"paired"``, :class:`~lightning_dvi.callbacks.PairedEarlyStopping` with ``z =
    selection_z``, ``skip = selection_skip``, ``patience_on``, ``trim = selection_trim`` and
    ``patience_growth``:
    the last step that the carve-out's per-row log-likelihoods do not show worse than the best
    by more than ``z`` standard errors. ``selection_mixture`` > 0 (``"paired"``, full-batch path
    only): the test rows are scored by the callback's mixture of the last kept steps'
    predictives, its window chosen on the carve-out (``PairedEarlyStopping(mixture=...)``;
    issue 45); on the large-table path the Adam phase starts from the restored step as before.

    Large tables (``optimizer="lbfgs"`` with the ``"point"`` or ``"none"`` warm start, more
    than ``large_rows`` training rows; 0 turns the rule off): ``large_subsample``,
    ``large_subsample_steps``, ``large_batch_size``, ``large_epochs``, ``large_lr`` and
    ``large_final_lr_fraction`` (the module docstring).

    ``compiled`` = 1: the regressor's ``compile=True`` (the step as one compiled graph in the
    deterministic modes; its compile, or the load from inductor's cache, is in the CPU time).
    """

    optimizer: Literal["lbfgs", "adam"] = "lbfgs"
    lbfgs_iterations: int = 10
    lbfgs_history: int = 50
    early_stopping_fraction: float = 0.1
    patience: int = 5
    lr: float = 2e-2
    batch_size: int = 64
    epochs: float = 60.0
    min_steps: int = 1
    max_steps: int = 300
    final_lr_fraction: float = 0.01
    kl_warmup: float = 0.5
    kl_anneal: float = 0.1
    grad_clip: float = 0.0
    init_log_noise: float = -3.0
    fixed_prior_variance: float = 1.0
    mc_eval_samples: int = 100
    seed: int = 0
    adam_steps: int = 300
    adam_max_rows: int = 5000
    precision: Literal["32-true", "64-true"] = "32-true"
    target_resolution: str = "auto"
    warm_start: Literal["point", "adam", "none"] = "point"
    selection: Literal["best", "paired"] = "paired"
    selection_z: float = 0.5
    selection_skip: int = 3
    patience_on: Literal["best", "kept"] = "kept"
    selection_trim: int = 1
    large_rows: int = 5000
    large_subsample: int = 4096
    large_subsample_steps: int = 20
    large_batch_size: int = 1024
    large_epochs: float = 16.0
    large_lr: float = 1e-2
    large_final_lr_fraction: float = 0.1
    patience_growth: float = 0.0
    selection_mixture: int = 0
    compiled: int = 0

    @property
    def regressor_resolution(self) -> float | Literal["auto"] | None:
        """``DVIRegressor(target_resolution=...)``: ``"auto"``, ``None`` for ``"none"``, or a step."""
        if self.target_resolution in ("auto", "none"):
            return None if self.target_resolution == "none" else "auto"
        return float(self.target_resolution)


PRESETS: dict[str, Settings] = {
    "lbfgs": Settings(),
    "lbfgs-full-batch": Settings(large_rows=0),
    "lbfgs-best": Settings(
        selection="best", selection_skip=0, selection_trim=0, patience_on="best", large_rows=0
    ),
    "lbfgs-adam": Settings(
        warm_start="adam",
        selection="best",
        selection_skip=0,
        selection_trim=0,
        patience_on="best",
    ),
    "adam8000": Settings(
        optimizer="adam",
        early_stopping_fraction=0.0,
        min_steps=8000,
        max_steps=10000,
        kl_warmup=0.5,
        kl_anneal=0.1,
        grad_clip=5.0,
        target_resolution="none",
        warm_start="none",
    ),
}
DEFAULTS = PRESETS["lbfgs"]


def num_steps(num_train: int, settings: Settings) -> int:
    """Optimisation steps: Adam ``clip(epochs * ceil(N / batch), min, max)``; L-BFGS ``max_steps``."""
    if settings.optimizer == "lbfgs":
        return settings.max_steps
    per_epoch = math.ceil(num_train / settings.batch_size)
    steps = math.ceil(settings.epochs * per_epoch)
    return int(min(max(steps, settings.min_steps), settings.max_steps))


def dataset_folder(data_dir: Path, name: str) -> Path:
    """``data_dir/name``, checked to hold a dataset in the standard layout.

    Raises:
        ValueError: naming the missing folder (and the datasets there) or file.
    """
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


@dataclass(frozen=True)
class Job:
    """One (dataset, method, split) training run.

    ``validation > 0`` scores on that fraction of the training split instead of the test split
    (hyper-parameter search); early stopping is then off, so the score is not the stopping
    rule's own carve-out.
    """

    data_dir: str
    dataset: str
    method: str
    split: int
    hidden: int
    validation: float
    steps_cap: int | None
    settings: Settings

    @property
    def effective_settings(self) -> Settings:
        """The job's settings; Monte Carlo methods fall back to Adam (``"adam8000"``)."""
        s = self.settings
        if s.optimizer == "lbfgs" and METHODS[self.method]["mode"] in ("sample", "local"):
            base = PRESETS["adam8000"]
            return replace(base, mc_eval_samples=s.mc_eval_samples, seed=s.seed)
        return s


def make_jobs(
    data_dir: Path,
    datasets: Sequence[str],
    methods: Sequence[str],
    settings: Settings,
    splits: int | None = None,
    validation: float = 0.0,
    steps_cap: int | None = None,
) -> list[Job]:
    """Every (dataset, method, split) job; ``splits=None`` runs all the dataset's splits.

    Raises:
        ValueError: for an unknown method or dataset, or more splits than a dataset has.
    """
    from lightning_dvi.data.uci import count_uci_splits

    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    jobs = []
    for dataset in datasets:
        folder = dataset_folder(data_dir, dataset)
        available = count_uci_splits(folder)
        k = available if splits is None else splits
        if k > available:
            raise ValueError(f"--splits {k}: {dataset} has only {available} splits")
        hidden = hidden_width(folder)
        for method in methods:
            jobs += [
                Job(str(data_dir), dataset, method, split, hidden, validation, steps_cap, settings)
                for split in range(k)
            ]
    return jobs


def _quiet() -> None:
    # Lightning's per-run banners and hints would bury the per-split lines of 105 runs.
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)
    for message in (".*does not have many workers.*", ".*number of training batches.*",
                    ".*LeafSpec.*", ".*sees 1 batches.*"):  # fmt: skip
        warnings.filterwarnings("ignore", message)


def run_job(
    job: Job,
    accelerator: Literal["cpu", "gpu"] = "cpu",
    extra_scores: Callable[[Any, Any, Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Train one split and score it.

    ``accelerator`` is the Trainer's: ``"gpu"`` trains on one CUDA device (the GPU suite,
    :mod:`lightning_dvi_benchmarks.gpu_suite`); scoring runs on the CPU either way.
    ``extra_scores(model, x, y)``, when given, scores the fitted model (restored step, eval
    mode) on the held-out rows in some other way; its dict is merged into the result.

    Returns:
        ``{"split", "test_ll", "rmse", "seconds", "cpu_seconds", "steps", "adam_steps",
        "warm_start_steps", "kept_step", "mixture_steps"}``: ``mixture_steps`` is the number of
        kept steps mixed to score the test rows (``selection_mixture > 0`` on the full-batch
        path, else ``None``); ``steps`` is the number of optimisation steps run (L-BFGS steps
        of ``lbfgs_iterations`` iterations), ``adam_steps`` those of the ``"adam"`` warm
        start's Adam phase and ``warm_start_steps`` the ``"point"`` warm start's L-BFGS steps
        (0 if none).
    """
    import torch

    torch.set_num_threads(1)
    import lightning

    from lightning_dvi.callbacks import (
        PointEstimateWarmStart,
        RestoreBestWeights,
    )
    from lightning_dvi.data import UCIDataModule
    from lightning_dvi.lightning import DVIRegressor

    _quiet()
    start, cpu_start = time.perf_counter(), time.process_time()
    s, spec = job.effective_settings, METHODS[job.method]
    seed = s.seed + job.split
    lightning.seed_everything(seed, workers=True, verbose=False)
    lbfgs = s.optimizer == "lbfgs"
    early = s.early_stopping_fraction if job.validation == 0 else 0.0
    dm = UCIDataModule(
        job.data_dir,
        job.dataset,
        split=job.split,
        val_fraction=job.validation or early,
        batch_size=s.batch_size,
        seed=seed,
    )
    if lbfgs:  # one batch: the whole training (and validation) set
        dm.batch_size = max(dm.num_train, 1)
    steps = num_steps(dm.num_train, s)
    if job.steps_cap is not None:
        steps = min(steps, job.steps_cap)

    num_data = dm.num_train

    def build(
        optimizer: str,
        warmup: int,
        anneal: int,
        cosine: bool,
        lr: float = s.lr,
        final: float = s.final_lr_fraction,
    ) -> Any:
        return DVIRegressor(
            in_features=dm.in_features,
            hidden=[job.hidden],
            mode=spec["mode"],
            num_samples=spec.get("num_samples"),
            likelihood=spec["likelihood"],
            prior=spec["prior"],
            prior_alpha=1.0,
            prior_beta=10.0,
            prior_variance=s.fixed_prior_variance,
            lr=lr,
            lr_schedule="cosine" if cosine else "constant",
            min_lr=lr * final if cosine else 0.0,
            kl_warmup_steps=warmup,
            kl_anneal_steps=anneal,
            init_log_noise=s.init_log_noise,
            num_data=num_data,
            optimizer=optimizer,
            lbfgs_iterations=s.lbfgs_iterations,
            lbfgs_history=s.lbfgs_history,
            # early stopping reads only val/nll; the other validation values cost more than the
            # validation's forward pass when it runs after every step
            val_metrics=["nll"],
            target_resolution=s.regressor_resolution,
            compile=bool(s.compiled),
        )

    def trainer(
        max_steps: int, callbacks: list[Any], validate: bool, clip: float, every: int = 1
    ) -> Any:
        return lightning.Trainer(
            accelerator=accelerator,
            devices=1,
            max_steps=max_steps,
            max_epochs=-1,
            precision=s.precision,
            limit_val_batches=1.0 if validate else 0,
            check_val_every_n_epoch=every,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
            num_sanity_val_steps=0,
            # Nothing reads logged training values here (see DVIModule: logs_this_step).
            log_every_n_steps=max_steps + 1,
            gradient_clip_val=clip or None,
            callbacks=callbacks,
        )

    if lbfgs and s.warm_start != "adam" and 0 < s.large_rows < dm.num_train:
        model, counts = _run_large(job, s, dm, build, trainer, early)
        scored = _scored(job, model, dm, s, start, cpu_start, extra=extra_scores)
        return {**scored, **counts, "protocol": "large"}
    warm, a = None, 0
    adam_first = lbfgs and s.warm_start == "adam" and s.adam_steps > 0
    if adam_first and dm.num_train <= s.adam_max_rows:  # Adam first (KL warm-up)
        a = s.adam_steps
        warm = build("adam", round(s.kl_warmup * a), round(s.kl_anneal * a), False)
        trainer(a, [], False, s.grad_clip).fit(warm, datamodule=dm)
    model = build(
        s.optimizer,
        0 if lbfgs else round(s.kl_warmup * steps),
        0 if lbfgs else round(s.kl_anneal * steps),
        not lbfgs,
    )
    if warm is not None:
        model.to(next(warm.parameters()).dtype).load_state_dict(warm.state_dict())
    callbacks: list[Any] = []
    point = PointEstimateWarmStart(patience=s.patience)
    if lbfgs and s.warm_start == "point":  # inside the Trainer: its cost is the run's
        callbacks.append(point)
    paired = None
    if early > 0 and s.selection == "paired":
        paired = _paired_stopping(s)
        callbacks.append(paired)
    elif early > 0:
        callbacks += [
            lightning.pytorch.callbacks.EarlyStopping("val/nll", patience=s.patience),
            RestoreBestWeights("val/nll"),
        ]
    trainer_ = trainer(steps, callbacks, early > 0, 0.0 if lbfgs else s.grad_clip)
    trainer_.fit(model, datamodule=dm)
    mixed = None
    if paired is not None and paired.mixture_steps is not None:
        mixed = paired.mixture_predictive(model)
    return {
        **_scored(job, model, dm, s, start, cpu_start, mixed, extra_scores),
        "mixture_steps": None if mixed is None else len(mixed),
        "steps": int(trainer_.global_step),
        "adam_steps": a,
        "warm_start_steps": 0 if point.result is None else point.result.steps,
        "kept_step": None if paired is None else paired.kept_step,
        "protocol": "full-batch",
    }


def _paired_stopping(s: Settings) -> Any:
    """The :class:`~lightning_dvi.callbacks.PairedEarlyStopping` of ``s``'s selection fields."""
    from lightning_dvi.callbacks import PairedEarlyStopping

    return PairedEarlyStopping(
        patience=s.patience,
        z=s.selection_z,
        skip=s.selection_skip,
        patience_on=s.patience_on,
        trim=s.selection_trim,
        patience_growth=s.patience_growth,
        mixture=s.selection_mixture,
    )


def _scored(
    job: Job,
    model: Any,
    dm: Any,
    s: Settings,
    start: float,
    cpu_start: float,
    mixed: Any = None,
    extra: Callable[[Any, Any, Any], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The split, the held-out test LL and RMSE, and the job's wall and CPU seconds so far.

    ``mixed`` (a :class:`~lightning_dvi.lightning.early_stopping.SnapshotMixture`): scored
    instead of ``model``, by its mixture density and the RMSE of its mean.
    """
    held_out = dm.val_dataset if job.validation > 0 else dm.test_dataset
    assert held_out is not None
    x, y = held_out.tensors[0], held_out.tensors[1]
    if mixed is not None:
        x = x.to(next(model.parameters()).dtype)
        test_ll = float(mixed.predictive_log_prob(x, y).mean())
        rmse = float((mixed.predictive(x)[0] - y.double()).square().mean().sqrt())
    else:
        test_ll, rmse = score(model, x, y, s.mc_eval_samples)
    timing = {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
    }  # before the extra scores: they are not the protocol's cost
    more = {} if extra is None else extra(model, x.to(next(model.parameters()).dtype), y)
    return {"split": job.split, "test_ll": test_ll, "rmse": rmse, **timing, **more}


def _train_rows(dm: Any, rows: int, seed: int) -> Any:
    """A data module of ``rows`` seeded random training rows of ``dm`` as one batch.

    Its validation batches and ``test_dataset`` are ``dm``'s, and it declares ``dm``'s target
    statistics (:class:`~lightning_dvi.transforms.TargetStatistics`), so a regressor fitted on
    it standardises the targets as one fitted on every training row does.
    """
    import torch
    from lightning import LightningDataModule
    from torch.utils.data import DataLoader, TensorDataset

    full = dm.train_dataset
    generator = torch.Generator().manual_seed(seed)
    keep = torch.randperm(len(full), generator=generator)[: min(rows, len(full))].sort().values
    subset = TensorDataset(*(t[keep] for t in full.tensors))

    class TrainRows(LightningDataModule):
        targets_standardized = False
        target_loc, target_scale = float(dm.target_loc), float(dm.target_scale)
        test_dataset = dm.test_dataset  # for callbacks that score the test rows per step

        def train_dataloader(self) -> Any:
            # the whole subset as one ready batch: no per-row fetch and collate each step
            return DataLoader([subset.tensors], batch_size=None)  # type: ignore[arg-type]  # a list is a map-style dataset

        def val_dataloader(self) -> Any:
            return dm.val_dataloader()

    return TrainRows()


def _run_large(
    job: Job,
    s: Settings,
    dm: Any,
    build: Callable[..., Any],
    trainer: Callable[..., Any],
    early: float,
) -> tuple[Any, dict[str, Any]]:
    """The large-table protocol (module docstring); returns the model and the step counts.

    1. On ``large_subsample`` seeded training rows (one batch, ``num_data`` still the full
       training set's): the point-estimate warm start, then at most ``large_subsample_steps``
       L-BFGS steps on the ELBO, early-stopped on the carve-out (paired, as the default).
    2. On every training row: Adam on mini-batches of ``large_batch_size`` for
       ``large_epochs`` epochs, learning rate ``large_lr`` decayed (cosine) to
       ``large_final_lr_fraction`` of it, the KL at full weight.
    """
    from lightning_dvi.callbacks import PointEstimateWarmStart

    cap = job.steps_cap
    rows = _train_rows(dm, s.large_subsample, s.seed + job.split)
    first = build("lbfgs", 0, 0, False)
    point = PointEstimateWarmStart(patience=s.patience, mode="point")
    callbacks: list[Any] = [point] if s.warm_start == "point" else []
    paired = _paired_stopping(s) if early > 0 else None
    if paired is not None:
        callbacks.append(paired)
    sub_steps = s.large_subsample_steps if cap is None else min(s.large_subsample_steps, cap)
    fit_sub = trainer(sub_steps, callbacks, early > 0, 0.0)
    fit_sub.fit(first, datamodule=rows)
    dm.batch_size = min(s.large_batch_size, dm.num_train)
    steps = math.ceil(s.large_epochs * math.ceil(dm.num_train / dm.batch_size))
    steps = steps if cap is None else min(steps, cap)
    model = build("adam", 0, 0, True, s.large_lr, s.large_final_lr_fraction)
    model.load_state_dict(first.state_dict())
    fit_adam = trainer(steps, [], False, 0.0)
    if steps > 0:
        fit_adam.fit(model, datamodule=dm)
    return model, {
        "steps": int(fit_sub.global_step),
        "adam_steps": int(fit_adam.global_step) if steps > 0 else 0,
        "warm_start_steps": 0 if point.result is None else point.result.steps,
        "kept_step": None if paired is None else paired.kept_step,
        "mixture_steps": None,  # the Adam phase's model is scored, not a mixture
    }


def score(model: Any, x: Any, y: Any, mc_eval_samples: int) -> tuple[float, float]:
    r"""Mean log-likelihood per point and RMSE, both in the original units of ``y``.

    ``full``/``diag``: the model's closed-form predictive (no sampling): its
    ``predictive_log_prob``, for the heteroscedastic likelihood the exact density of
    :math:`\int\mathcal N(y; m, e^\ell)\,q(m,\ell)` (before 2026-11-29: the Gaussian with its
    moments, as the paper and ``docs/uci_results.json``). ``sample``/``local``: the Monte Carlo
    mixture :math:`\log\frac1S\sum_s p(y\mid x, w_s)` over ``mc_eval_samples`` weight draws
    (the usual MCVI evaluation), RMSE of the mixture mean.
    """
    import torch

    model.eval()
    x, y = x.to(next(model.parameters()).dtype), y.double()
    with torch.no_grad():
        if model.mode in ("sample", "local"):
            ll = model.predictive_log_prob(x, y, method="mc", num_samples=mc_eval_samples)
            mean, _ = model.predictive(x, method="mc", num_samples=mc_eval_samples)
        else:
            mean, _ = model.predictive(x)
            ll = model.predictive_log_prob(x, y)
    rmse = float((mean - y).square().mean().sqrt())
    return float(ll.mean()), rmse


@functools.cache
def _rows(data_dir: str, dataset: str) -> int:
    with open(Path(data_dir) / dataset / "data.txt") as f:
        return sum(1 for _ in f)


def _cost(job: Job) -> float:
    return _rows(job.data_dir, job.dataset) * job.hidden * (10 if job.method == "mcvi" else 1)


def run(
    jobs: Sequence[Job],
    workers: int,
    report: Callable[[Job, dict[str, Any]], None] | None = None,
) -> list[dict[str, Any]]:
    """Run the jobs (largest first, for load balance) and summarise per (dataset, method).

    ``workers`` processes (spawned, one thread each) each run many jobs, so interpreter and
    import start-up are paid once per worker, not per split. ``report(job, result)`` is called
    as each job finishes.
    """
    outcomes: dict[tuple[str, str], list[dict[str, Any]]] = {}
    order = sorted(range(len(jobs)), key=lambda i: -_cost(jobs[i]))

    def record(job: Job, result: dict[str, Any]) -> None:
        if report is not None:
            report(job, result)
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
