r"""``PointEstimateWarmStart``: fit the posterior means as a plain network when training starts.

The Lightning front end of :func:`lightning_dvi.warm_start.fit_point_estimate`: at the start of
``fit`` (after a checkpoint would be restored, before the first optimisation step) it gathers
every training batch into one, and the validation batches (early stopping) when the run has any,
fits the network with every weight at its posterior mean on the likelihood's point-fit loss by
full-batch L-BFGS, and hands the fitted means to the ELBO's optimiser. A run without
validation batches holds out a seeded ``holdout`` fraction of the training rows for the
warm start's early stopping (the ELBO still trains on every row): a point estimate fitted to
convergence over-fits (diabetes, 50 hidden units: 200 steps, 8 CPU s, where early stopping
takes a few). A run resumed from a checkpoint (``global_step > 0``) is not warm-started again.

Meant for data that fits in memory in one batch (UCI-size tables); the fit holds all training
rows at once. Under data-parallel training each process gathers every process's batches (which
the distributed sampler makes the same size), so all fit the whole set, and rank 0's means are
broadcast afterwards.

Large tables (issue 44): ``mode="auto"`` (the default) skips the fit when the run trains on
mini-batches (more than one training batch per epoch, e.g. the CSV recipe's ``--model.optimizer
adam --data.batch_size 256``): a table too large for one batch is too large for a full-batch fit
that costs many epochs' time. ``mode="none"`` turns it off (the CLI's ``--warm_start none``),
``mode="point"`` fits even then. A kept fit on more than ``max_rows`` training rows fits a
seeded random ``max_rows`` of them (50,000 by default, more than any UCI table's training set).
The fit prints its progress (step, training and held-out loss, elapsed time) through the run's
progress callback (:func:`~lightning_dvi.lightning.progress.phase_progress`): a first line
before its first step, with the rows and the process's peak memory, then one per interval.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal, cast

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor

from ..nn import parameter_groups
from ..warm_start import PointFit, fit_point_estimate
from ._base import DVIModule
from ._validation import one_of, optional_positive_int, positive_int
from .progress import describe_peak_memory, phase_progress

__all__ = ["WARM_START_MODES", "PointEstimateWarmStart", "WarmStartMode", "switch_warm_start"]

WarmStartMode = Literal["auto", "point", "none"]
WARM_START_MODES: tuple[WarmStartMode, ...] = ("auto", "point", "none")


def _loaders(value: Any) -> list[Iterable[Any]]:
    if value is None:
        return []
    if isinstance(value, dict):
        return list(value.values())
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _rows(module: DVIModule, loaders: list[Iterable[Any]]) -> tuple[Tensor, Tensor] | None:
    """Every ``(x, y)`` batch of the loaders, concatenated, on the module's device."""
    xs, ys = [], []
    for loader in loaders:
        for batch in loader:
            x, y = batch[0], batch[1]
            xs.append(x.to(module.device))
            ys.append(module._network_targets(y.to(module.device)))
    if not xs:
        return None
    x, y = torch.cat(xs), torch.cat(ys)
    if module.trainer.world_size > 1:  # every process fits on the whole set, not its shard
        x, y = (cast(Tensor, module.all_gather(t)).flatten(0, 1) for t in (x, y))
    return x, y


def _validation_loaders(trainer: Trainer) -> Any:
    """The fit's validation dataloaders, or ``None`` (none given, or ``limit_val_batches=0``)."""
    if not trainer.enable_validation:  # no validation data, or limit_val_batches=0
        return None
    trainer.fit_loop.epoch_loop.val_loop.setup_data()  # Lightning's is lazy; idempotent
    return trainer.val_dataloaders


def _hold_out(
    rows: tuple[Tensor, Tensor], fraction: float, seed: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor] | None]:
    """Split off ``round(fraction * N)`` random rows (at least one row stays on each side)."""
    n = rows[0].shape[0]
    k = min(max(round(fraction * n), 1), n - 1)
    if k < 1:
        return rows, None
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).to(rows[0].device)
    held, kept = order[:k], order[k:]
    return (rows[0][kept], rows[1][kept]), (rows[0][held], rows[1][held])


def _subsample(rows: tuple[Tensor, Tensor], max_rows: int, seed: int) -> tuple[Tensor, Tensor]:
    """A seeded random ``max_rows`` of the rows, in their order (all of them if no more)."""
    n = rows[0].shape[0]
    if n <= max_rows:
        return rows
    generator = torch.Generator().manual_seed(seed + 1)  # not the holdout's draw
    keep = torch.randperm(n, generator=generator)[:max_rows].sort().values.to(rows[0].device)
    return rows[0][keep], rows[1][keep]


def _count(n: int) -> str:
    return f"{n:,}"


class PointEstimateWarmStart(Callback):
    """Fit the posterior means as a point estimate before the first optimisation step.

    Args:
        max_steps: at most this many L-BFGS steps.
        patience: stop after this many steps without a lower validation loss (when the run has
            validation batches; otherwise the fit runs until the loss stops changing).
        iterations: L-BFGS iterations per step.
        history_size: L-BFGS curvature pairs kept.
        holdout: without validation batches, the fraction of the training rows held out (at
            random, seeded by ``seed``) for the warm start's early stopping; 0 fits all rows
            until the loss stops changing or ``max_steps``.
        seed: the holdout's and the subsample's seed.
        mode: ``"auto"`` fits unless the run trains on mini-batches (more than one training
            batch per epoch: the table is too large for a full-batch fit); ``"point"`` always
            fits; ``"none"`` turns the warm start off (the CLI's ``--warm_start none``).
        max_rows: fit on at most this many training rows, a seeded random subset of a larger
            training set (``None``: every row). The held-out rows are all used (they are only
            evaluated, once per step).

    Attributes:
        result: the last fit's :class:`~lightning_dvi.warm_start.PointFit` (``None`` before
            one, when the run was resumed, or when the warm start was off).
        skipped: why the last run was not warm-started (``None`` when it was).

    Examples:
        >>> import lightning
        >>> from lightning_dvi import DVIRegressor
        >>> from lightning_dvi.callbacks import PointEstimateWarmStart
        >>> warm = PointEstimateWarmStart()
        >>> trainer = lightning.Trainer(max_steps=20, callbacks=[warm], logger=False)
        >>> off = PointEstimateWarmStart(mode="none")  # the same configuration, switched off
    """

    def __init__(
        self,
        max_steps: int = 200,
        patience: int = 5,
        iterations: int = 20,
        history_size: int = 50,
        holdout: float = 0.1,
        seed: int = 0,
        mode: WarmStartMode = "auto",
        max_rows: int | None = 50_000,
    ) -> None:
        for name, value in (
            ("max_steps", max_steps),
            ("patience", patience),
            ("iterations", iterations),
            ("history_size", history_size),
        ):
            positive_int(f"PointEstimateWarmStart: {name}", value)
        if not (isinstance(holdout, (int, float)) and 0.0 <= holdout < 1.0):
            raise ValueError(f"PointEstimateWarmStart: holdout must be in [0, 1), got {holdout!r}")
        self.mode = cast(
            WarmStartMode, one_of("PointEstimateWarmStart: mode", mode, WARM_START_MODES)
        )
        self.max_rows = optional_positive_int("PointEstimateWarmStart: max_rows", max_rows)
        self.holdout, self.seed = float(holdout), int(seed)
        self.max_steps, self.patience = max_steps, patience
        self.iterations, self.history_size = iterations, history_size
        self.result: PointFit | None = None
        self.skipped: str | None = None

    def _skip_reason(self, trainer: Trainer) -> str | None:
        if self.mode == "none":
            return "off (mode='none', --warm_start none)"
        batches = trainer.num_training_batches
        if self.mode == "auto" and math.isfinite(batches) and batches > 1:
            return (
                f"off: the run trains on mini-batches ({int(batches):,} per epoch), and a "
                "full-batch fit of a table that size costs many epochs (mode='point', "
                "--warm_start point, fits anyway)"
            )
        return None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Gather the data and fit the means (skipped when the run resumes a checkpoint)."""
        self.result, self.skipped = None, None
        if trainer.global_step > 0:
            self.skipped = "resumed"
            return
        if not isinstance(pl_module, DVIModule):
            raise TypeError(
                "PointEstimateWarmStart needs a DVIRegressor or DVIClassifier, got "
                f"{type(pl_module).__name__}"
            )
        progress = phase_progress(trainer, "warm start", self.max_steps)
        self.skipped = self._skip_reason(trainer)
        if self.skipped is not None:
            progress.write(self.skipped)
            if not progress.enabled:
                rank_zero_info(f"PointEstimateWarmStart: {self.skipped}")
            return
        train = _rows(pl_module, _loaders(trainer.train_dataloader))
        if train is None:
            raise ValueError("PointEstimateWarmStart: the training dataloader gave no batches")
        val = _rows(pl_module, _loaders(_validation_loaders(trainer)))
        if val is None and self.holdout > 0:
            train, val = _hold_out(train, self.holdout, self.seed)
        total = train[0].shape[0]
        if self.max_rows is not None:
            train = _subsample(train, self.max_rows, self.seed)
        rows = _count(train[0].shape[0]) + (
            "" if total == train[0].shape[0] else f" of {_count(total)}"
        )
        columns = "x".join(str(d) for d in train[0].shape[1:]) or "1"
        held = "" if val is None else f", {_count(val[0].shape[0])} held out"
        progress.start(
            f"fitting the means as a plain network on {rows} training rows x {columns} inputs"
            f"{held} (full batch, L-BFGS, at most {self.max_steps} steps of {self.iterations} "
            f"iterations); {describe_peak_memory()}"
        )

        def report(step: int, train_loss: float, val_loss: float | None) -> None:
            metrics = {"loss": train_loss, "held-out loss": val_loss}
            progress.step(step, metrics, force=step == 0)

        with torch.enable_grad():
            self.result = fit_point_estimate(
                pl_module.net,
                pl_module.likelihood,
                train[0],
                train[1],
                None if val is None else val[0],
                None if val is None else val[1],
                max_steps=self.max_steps,
                patience=self.patience,
                iterations=self.iterations,
                history_size=self.history_size,
                progress=report if progress.enabled else None,
            )
        if trainer.world_size > 1:  # the processes fitted the same rows; keep them identical
            means = [g.loc for g in parameter_groups(pl_module.net)]
            fitted = trainer.strategy.broadcast([m.detach().clone() for m in means], src=0)
            with torch.no_grad():
                for mean, value in zip(means, fitted, strict=True):
                    mean.copy_(value)
        r = self.result
        summary = (
            f"{r.steps} L-BFGS steps on {rows} training rows ({r.stopped}), kept step "
            f"{r.best_step}: train loss "
            f"{r.train_loss:.4g}"
            + ("" if r.val_loss is None else f", validation loss {r.val_loss:.4g}")
        )
        if progress.enabled:
            progress.write(f"done, {summary}, {progress.elapsed:.1f} s, {describe_peak_memory()}")
        else:
            rank_zero_info(f"PointEstimateWarmStart: {summary}")


def switch_warm_start(callbacks: Iterable[Callback], mode: WarmStartMode | None) -> list[Callback]:
    """Apply the CLI's ``--warm_start MODE`` to a run's callbacks; returns the ones to add.

    Every :class:`PointEstimateWarmStart` among ``callbacks`` gets ``mode``; when there is none
    and ``mode`` is ``"auto"`` or ``"point"``, a default one with that mode is returned to be
    added. ``None`` (the option not given) changes nothing.

    Raises:
        ValueError: on a mode other than ``"auto"``, ``"point"``, ``"none"`` or ``None``.
    """
    if mode is None:
        return []
    mode = cast(WarmStartMode, one_of("--warm_start", mode, WARM_START_MODES))
    warm = [c for c in callbacks if isinstance(c, PointEstimateWarmStart)]
    for callback in warm:
        callback.mode = mode
    return [] if warm or mode == "none" else [PointEstimateWarmStart(mode=mode)]
