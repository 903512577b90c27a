"""Progress where a person watches, plain log lines where none does.

:func:`progress_callback` picks, for the ``lightning-dvi`` CLI: :class:`DVIProgressBar`
(Lightning's TQDM bar, with the training loss and the key validation metric) when standard
error is a terminal, otherwise :class:`ProgressLog`, which prints one plain line every few
seconds (no carriage returns, so CI logs and files piped to stay readable). The environment
variable ``CI`` (set by GitHub Actions, GitLab CI and most others) selects the plain lines even
on a terminal.

A phase that runs inside ``fit`` before the first optimisation step (the point-estimate warm
start, :class:`~lightning_dvi.callbacks.PointEstimateWarmStart`) reports through the same
callback: :func:`phase_progress` gives it a :class:`PhaseProgress`, which writes plain lines
(``warm start: step 3/200  loss 0.41  held-out loss 0.45  36.2 s``) at the
:class:`ProgressLog`'s interval, or one line per step on a terminal bar's standard error, and
nothing when the run has no progress callback. :func:`peak_memory` reads the process's peak
resident set size for the lines that report the data's size.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from contextlib import redirect_stdout
from typing import IO, Any

try:  # POSIX only; peak_memory() says "unknown" elsewhere
    import resource
except ImportError:  # pragma: no cover - Windows
    resource = None  # type: ignore[assignment]  # the module is absent: peak_memory() checks

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

__all__ = [
    "DVIProgressBar",
    "PhaseProgress",
    "ProgressLog",
    "describe_data",
    "describe_peak_memory",
    "peak_memory",
    "phase_progress",
    "progress_callback",
    "progress_metrics",
]

# The loss, then the key metrics: NLL (regression and classification), accuracy (classification).
PROGRESS_KEYS = ("train/loss", "val/nll", "val/acc")


def progress_metrics(trainer: Trainer) -> dict[str, float]:
    """The latest training loss and key validation metrics the module logged (those it has)."""
    values: dict[str, float] = {}
    for key in PROGRESS_KEYS:
        value = trainer.callback_metrics.get(key)
        if value is not None and value.numel() == 1:
            values[key] = float(value)
    return values


def peak_memory() -> int | None:
    """The process's peak resident set size so far, in bytes (``None`` where unknown).

    ``resource.getrusage(RUSAGE_SELF).ru_maxrss``: kibibytes on Linux, bytes on macOS.
    """
    if resource is None:  # pragma: no cover - Windows
        return None
    peak = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return peak if sys.platform == "darwin" else peak * 1024


def describe_peak_memory() -> str:
    """``"peak memory 1.93 GB"`` (resident set size; ``"peak memory unknown"`` where unknown)."""
    peak = peak_memory()
    if peak is None:  # pragma: no cover - Windows
        return "peak memory unknown"
    if peak >= 1e9:
        return f"peak memory {peak / 1e9:.2f} GB"
    return f"peak memory {peak / 1e6:.0f} MB"


def describe_data(datamodule: object) -> str | None:
    """``"280,000 training rows (40,000 validation, 80,000 test) x 9 inputs; peak memory 1.93 GB"``.

    The row counts and inputs a data module has (``num_train``, ``num_val``, ``num_test``,
    ``in_features``; ``None`` if it has no ``num_train``) with :func:`describe_peak_memory`.
    """
    counts: dict[str, int] = {}
    for name in ("num_train", "num_val", "num_test", "in_features"):
        try:
            value = getattr(datamodule, name, None)
        except Exception:  # a data module whose split is not built: leave it out
            value = None
        if isinstance(value, int) and not isinstance(value, bool):
            counts[name] = value
    if "num_train" not in counts:
        return None
    labels = {"num_val": "validation", "num_test": "test"}
    others = [f"{counts[k]:,} {label}" for k, label in labels.items() if counts.get(k)]
    text = f"{counts['num_train']:,} training rows"
    text += f" ({', '.join(others)})" if others else ""
    text += f" x {counts['in_features']:,} inputs" if "in_features" in counts else ""
    return f"{text}; {describe_peak_memory()}"


class PhaseProgress:
    """Progress lines of a phase that runs inside ``fit`` before the first optimisation step.

    Made by :func:`phase_progress` from the run's progress callback. Lines are
    ``"<name>: <text>"``; :meth:`step` writes ``step k/total``, the metrics given and the time
    since :meth:`start`, at most once per ``every_n_seconds`` unless forced::

        warm start: step 3/200  loss 0.4123  held-out loss 0.4567  36.2 s

    Args:
        name: the lines' prefix (``"warm start"``).
        total: the most steps the phase can take.
        every_n_seconds: the least interval between step lines (0: every step).
        stream: where to write (default: ``sys.stderr`` at the time of writing).
        enabled: ``False`` writes nothing (no progress callback, or not rank zero).
    """

    def __init__(
        self,
        name: str,
        total: int,
        every_n_seconds: float = 10.0,
        stream: IO[str] | None = None,
        enabled: bool = True,
    ) -> None:
        if not (isinstance(every_n_seconds, (int, float)) and every_n_seconds >= 0):
            raise ValueError(f"every_n_seconds must be >= 0, got {every_n_seconds!r}")
        self.name, self.total = name, int(total)
        self.every_n_seconds = float(every_n_seconds)
        self.enabled = bool(enabled)
        self._stream = stream
        self._start = self._last = time.monotonic()

    @property
    def elapsed(self) -> float:
        """Seconds since :meth:`start` (or since the object was made)."""
        return time.monotonic() - self._start

    def write(self, text: str) -> None:
        """Write ``"<name>: <text>"`` now."""
        if self.enabled:
            stream = self._stream or sys.stderr
            stream.write(f"{self.name}: {text}\n")
            stream.flush()

    def start(self, text: str) -> None:
        """Start the clock and announce the phase."""
        self._start = self._last = time.monotonic()
        self.write(text)

    def step(self, step: int, metrics: Mapping[str, float | None], force: bool = False) -> None:
        """A step line, when ``every_n_seconds`` has passed since the last line (or ``force``).

        Args:
            step: the steps done (0: the start).
            metrics: name -> value; ``None`` values are left out.
            force: write even if the interval has not passed.
        """
        now = time.monotonic()
        if not force and now - self._last < self.every_n_seconds:
            return
        self._last = now
        parts = [f"step {step}/{self.total}"]
        parts += [f"{k} {v:.4g}" for k, v in metrics.items() if v is not None]
        parts.append(f"{now - self._start:.1f} s")
        self.write("  ".join(parts))


def phase_progress(trainer: Trainer, name: str, total: int) -> PhaseProgress:
    """A :class:`PhaseProgress` that writes where the run's progress callback writes.

    :class:`ProgressLog`: its stream and interval. Another enabled progress bar (a person
    watching a terminal): standard error, at most one line a second. No progress callback, a
    disabled one, or a process other than rank zero: a :class:`PhaseProgress` that writes
    nothing.
    """
    bar = trainer.progress_bar_callback
    if bar is None or not trainer.is_global_zero:
        return PhaseProgress(name, total, enabled=False)
    if isinstance(bar, ProgressLog):
        return PhaseProgress(
            name, total, bar.every_n_seconds, stream=bar._stream, enabled=bar._enabled
        )
    # TQDMProgressBar and RichProgressBar say whether they are on; the base class does not
    return PhaseProgress(name, total, 1.0, enabled=bool(getattr(bar, "is_enabled", True)))


class DVIProgressBar(TQDMProgressBar):
    """Lightning's TQDM progress bar on standard error, with the loss and key validation metrics.

    ``train/loss`` and ``val/nll`` (and ``val/acc`` for a classifier) are shown as soon as the
    module has logged them, without ``prog_bar=True`` in the module's logging calls. Lightning
    draws its bars on standard output; this one draws them on standard error, as progress
    meters do, so that standard output (the CLI's summary) can be piped or saved clean.
    """

    def init_sanity_tqdm(self) -> Tqdm:
        """Lightning's bar, on standard error."""
        with redirect_stdout(sys.stderr):
            return super().init_sanity_tqdm()

    def init_train_tqdm(self) -> Tqdm:
        """Lightning's bar, on standard error."""
        with redirect_stdout(sys.stderr):
            return super().init_train_tqdm()

    def init_validation_tqdm(self) -> Tqdm:
        """Lightning's bar, on standard error."""
        with redirect_stdout(sys.stderr):
            return super().init_validation_tqdm()

    def init_test_tqdm(self) -> Tqdm:
        """Lightning's bar, on standard error."""
        with redirect_stdout(sys.stderr):
            return super().init_test_tqdm()

    def init_predict_tqdm(self) -> Tqdm:
        """Lightning's bar, on standard error."""
        with redirect_stdout(sys.stderr):
            return super().init_predict_tqdm()

    def get_metrics(
        self, trainer: Trainer, pl_module: LightningModule
    ) -> dict[str, int | str | float | dict[str, float]]:
        """Lightning's items (the run's version) plus :func:`progress_metrics`."""
        items = super().get_metrics(trainer, pl_module)
        items.update({k.replace("train/", ""): v for k, v in progress_metrics(trainer).items()})
        return items


class ProgressLog(ProgressBar):
    """Training progress as plain lines on standard error, every ``every_n_seconds``.

    One line when training starts, one per interval and one when it ends (with the process's
    peak memory, :func:`describe_peak_memory`)::

        fit: epoch 37/300  step 370/3000 (12%)  train/loss -0.412  val/nll -0.731  4.1 s, ~30 s left

    It replaces Lightning's progress bar (it is a ``ProgressBar`` callback), prints on rank zero
    only, and keeps quiet during validation, test and predict (the CLI prints their metrics).

    Args:
        every_n_seconds: the interval between lines while training.
        stream: where to write (default: ``sys.stderr`` at the time of writing).
    """

    def __init__(self, every_n_seconds: float = 10.0, stream: IO[str] | None = None) -> None:
        super().__init__()
        if not (isinstance(every_n_seconds, (int, float)) and every_n_seconds > 0):
            raise ValueError(f"every_n_seconds must be > 0, got {every_n_seconds!r}")
        self.every_n_seconds = float(every_n_seconds)
        self._stream = stream
        self._enabled = True
        self._start = self._last = 0.0
        self._first_step = 0

    def disable(self) -> None:
        """Stop printing (Lightning calls this on non-zero ranks)."""
        self._enabled = False

    def enable(self) -> None:
        """Print again."""
        self._enabled = True

    def _write(self, line: str) -> None:
        if self._enabled:
            stream = self._stream or sys.stderr
            stream.write(line + "\n")
            stream.flush()

    def _status(self, trainer: Trainer, done: bool = False) -> str:
        epochs = trainer.max_epochs if trainer.max_epochs not in (None, -1) else None
        # while an epoch runs, current_epoch is its 0-based index; at the end, the epochs done
        epoch = f"epoch {trainer.current_epoch + (0 if done else 1)}" + (
            f"/{epochs}" if epochs else ""
        )
        total = trainer.estimated_stepping_batches
        step = f"step {trainer.global_step}"
        if math.isfinite(total) and total > 0:
            step += f"/{int(total)} ({100 * trainer.global_step / total:.0f}%)"
        metrics = "  ".join(f"{k} {v:.4g}" for k, v in progress_metrics(trainer).items())
        elapsed = time.monotonic() - self._start
        timing = f"{elapsed:.1f} s"
        steps_run = trainer.global_step - self._first_step
        if not done and steps_run > 0 and math.isfinite(total) and total > trainer.global_step:
            timing += f", ~{elapsed / steps_run * (total - trainer.global_step):.0f} s left"
        head = "fit: done," if done else "fit:"
        if done:
            timing += f", {describe_peak_memory()}"
        return "  ".join(part for part in (f"{head} {epoch}", step, metrics, timing) if part)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Announce the run."""
        self._start = self._last = time.monotonic()
        self._first_step = trainer.global_step
        resumed = f", resuming at step {trainer.global_step}" if trainer.global_step else ""
        batches = self.total_train_batches
        per_epoch = f"{batches} batches per epoch" if math.isfinite(batches) else "an epoch"
        self._write(
            f"fit: training, {per_epoch}{resumed}; progress every {self.every_n_seconds:g} s"
        )

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, *args: Any, **kwargs: Any
    ) -> None:
        """A line when the interval has passed."""
        now = time.monotonic()
        if now - self._last >= self.every_n_seconds:
            self._last = now
            self._write(self._status(trainer))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The final line."""
        self._write(self._status(trainer, done=True))


def _in_ci(environ: dict[str, str] | os._Environ[str]) -> bool:
    return environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def progress_callback(
    stream: IO[str] | None = None, environ: dict[str, str] | None = None
) -> Callback:
    """The progress callback for ``stream`` (default ``sys.stderr``).

    :class:`DVIProgressBar` when the stream is a terminal and ``CI`` is unset (or ``0``/``false``),
    otherwise :class:`ProgressLog` lines.
    """
    stream = stream if stream is not None else sys.stderr
    env = os.environ if environ is None else environ
    interactive = bool(getattr(stream, "isatty", lambda: False)()) and not _in_ci(env)
    return DVIProgressBar() if interactive else ProgressLog()
