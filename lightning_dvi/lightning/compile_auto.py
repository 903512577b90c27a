r"""``compile="auto"``: compile the ELBO step only when the planned run makes it pay.

Compiling the training step makes each step several times cheaper on a small network (the
eager step is dispatch-bound: docs/speed_current.md), but a cold inductor compile costs seconds
(the whole step as one graph, :class:`~lightning_dvi.compile.CompiledStep`, for the
deterministic modes) to tens of seconds (the forward through ``torch.compile``,
:class:`~lightning_dvi.compile.CompiledELBO`, for the sampled ones) on a CPU, more than a
whole small fit. A compile is paid once per network shape:
inductor keeps its compiled graphs in an on-disk cache (``TORCHINDUCTOR_CACHE_DIR``, by default
``/tmp/torchinductor_<user>``), and AOTAutograd its forward/backward graphs next to them
(:mod:`lightning_dvi.compile` admits the ELBO's custom autograd Functions to that cache), so a
second run of the same network only traces the Python step and loads them (about 4 CPU s
against 9 before AOTAutograd's cache hit, for the 2-layer net of docs/speed_current.md).

:class:`CompileAuto`, which :class:`~lightning_dvi.lightning._base.DVIModule` adds itself under
``compile="auto"``, decides once per fit:

1. the first :data:`MEASURED_STEPS` steps after the first run eagerly and are timed
   (:math:`t`, the median eager step);
2. with :math:`R` planned steps left (``trainer.estimated_stepping_batches``), an assumed
   speed-up :math:`k` of the compiled step (:data:`ASSUMED_SPEEDUP`) and the expected compile
   time :math:`C`, it compiles when the time saved pays for the compile,

   .. math:: R\,t\,(1 - 1/k) > C ;

3. :math:`C` is the compile time measured for the same network, mode, input shape and dtype on
   an earlier run (recorded next to inductor's cache, so it reflects a cache hit), or
   :data:`DEFAULT_COMPILE_SECONDS` before any was measured. After compiling, the first
   compiled step's time minus :math:`t` is recorded as the new :math:`C`.

The decision, its numbers and the measured compile time are logged (``rank_zero_info``) and
kept in :attr:`CompileAuto.decision`. Under DDP the first process decides for all.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from ..compile import compile_options, records_whole_step
from ..propagation import propagation

__all__ = [
    "ASSUMED_SPEEDUP",
    "DEFAULT_COMPILE_SECONDS",
    "MEASURED_STEPS",
    "AutoCompile",
    "CompileAuto",
    "CompileDecision",
    "compile_pays",
    "compile_setting",
    "compile_times_path",
]

MEASURED_STEPS = 3
"""Eager steps timed before the decision (after one untimed warm-up step)."""

ASSUMED_SPEEDUP = 1.5
"""The compiled step's assumed speed-up over the eager one: below the smallest measured, so that a
compile must pay clearly. The whole step as one graph (what ``compile=True`` runs in the
deterministic modes) on issue 39's 2-layer net, 2-core Intel Xeon, one thread, at ``c14260f``:
3.7x (width 50, batch 32), 2.3x (50, 512), 3.4x (128, 32), 2.2x (128, 512); 3.7-3.9x on the
compile-cost recipe's net (docs/speed_current.md); the
forward compiled through ``torch.compile`` (the sampled modes): 1.9-2.2x under load at
``48e5b2e``."""

DEFAULT_COMPILE_SECONDS = 60.0
"""The expected compile time, wall seconds, before any was measured for the network. Cold
compiles on a 2-core CPU: the whole step as one graph (``CompiledStep``, the deterministic
modes), about 6 CPU s in the process and 10 s wall for issue 39's one-hidden-layer regression
net, 13 CPU s + 16 in compile workers and 25 s wall with two hidden layers (Intel Xeon), 43
CPU s for a 64-unit digits classifier, whose categorical objective is the larger graph; the
forward through ``torch.compile`` (``CompiledELBO``, the sampled modes), 22 CPU s + 37 in
compile workers (AMD EPYC, ``48e5b2e``). From the caches a second run takes about 2-4 s."""


def compile_pays(
    remaining_steps: float,
    eager_step_seconds: float,
    compile_seconds: float,
    speedup: float = ASSUMED_SPEEDUP,
) -> bool:
    r"""Whether compiling saves more time than it costs: :math:`R\,t\,(1 - 1/k) > C`.

    Args:
        remaining_steps: :math:`R`, the planned steps still to run (``inf`` for an open run).
        eager_step_seconds: :math:`t`, one eager step.
        compile_seconds: :math:`C`, the expected compile time.
        speedup: :math:`k > 1`, the compiled step's speed-up.

    Examples:
        >>> compile_pays(30_000, 0.005, 60.0)  # 50 s saved at 1.5x < 60 s
        False
        >>> compile_pays(40_000, 0.005, 60.0)  # 66.7 s saved
        True
    """
    if not speedup > 1:
        raise ValueError(f"speedup must be > 1, got {speedup!r}")
    saved = remaining_steps * eager_step_seconds * (1.0 - 1.0 / speedup)
    return bool(saved > compile_seconds)


@dataclass(frozen=True)
class AutoCompile:
    """``compile="auto"``: decide at the start of a fit, then compile with ``options``."""

    options: dict[str, Any]


def compile_setting(
    compile: bool | str | dict[str, Any],
) -> tuple[dict[str, Any] | None, AutoCompile | None]:
    """A front end's ``compile=`` as ``(torch.compile options or None, AutoCompile or None)``.

    ``"auto"`` (or a dict with ``"auto": True`` next to ``torch.compile`` arguments) starts
    eager and leaves the decision to :class:`CompileAuto`; anything else is
    :func:`~lightning_dvi.compile.compile_options`.

    Raises:
        ValueError: as :func:`~lightning_dvi.compile.compile_options`, or for an ``"auto"`` key
            that is not a bool.
    """
    if compile == "auto":
        return None, AutoCompile({})
    if isinstance(compile, dict) and "auto" in compile:
        auto = compile["auto"]
        if not isinstance(auto, bool):
            raise ValueError(f"compile['auto'] must be a bool, got {auto!r}")
        options = compile_options({k: v for k, v in compile.items() if k != "auto"})
        return (None, AutoCompile(options or {})) if auto else (options, None)
    return compile_options(compile), None


def compile_times_path() -> Path:
    """Where measured compile times are recorded: next to inductor's on-disk cache.

    ``TORCHINDUCTOR_CACHE_DIR`` when set, else inductor's default ``<tmp>/torchinductor_<user>``.
    """
    root = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not root:
        root = os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}")
    return Path(root) / "lightning_dvi_compile_seconds.json"


def _read_times(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {str(k): float(v) for k, v in data.items() if isinstance(v, (int, float))}


def _write_time(path: Path, key: str, seconds: float) -> None:
    times = _read_times(path)
    times[key] = seconds
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(times, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:  # a read-only cache directory only costs the next decision its memory
        pass


def _whole_step(module: LightningModule, options: dict[str, Any]) -> bool:
    """Whether ``module`` compiles its step as one graph (``DVIModule._compiled_elbo``)."""
    how = propagation(getattr(module, "mode", "full"), getattr(module, "num_samples", None))
    return records_whole_step(how, options.get("mode"))


def _network_key(module: LightningModule, batch: Any, options: dict[str, Any]) -> str:
    """What a compiled graph depends on: the network, mode, input shape, dtype, device, torch."""
    x = batch[0] if isinstance(batch, (list, tuple)) else batch
    shape = tuple(x.shape[1:]) if isinstance(x, torch.Tensor) else ()
    parts = [
        repr(getattr(module, "net", module)),
        type(module).__qualname__,
        repr(getattr(module, "likelihood", None)),
        str(getattr(module, "mode", "")),
        str(getattr(module, "num_samples", "")),
        str(shape),
        str(getattr(x, "dtype", "")),
        str(getattr(x, "device", torch.device("cpu")).type),
        torch.__version__,
        json.dumps(options, sort_keys=True, default=str),
        "whole step" if _whole_step(module, options) else "forward",
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


@dataclass(frozen=True)
class CompileDecision:
    """What ``compile="auto"`` decided, and from which numbers.

    Attributes:
        compiled: whether the step is compiled from now on.
        remaining_steps: planned steps left at the decision.
        eager_step_seconds: the median measured eager step.
        compile_seconds: the expected compile time used.
        measured_before: whether ``compile_seconds`` was measured on an earlier run.
    """

    compiled: bool
    remaining_steps: float
    eager_step_seconds: float
    compile_seconds: float
    measured_before: bool

    def message(self) -> str:
        """One line for the log."""
        source = "measured on an earlier run" if self.measured_before else "default estimate"
        verdict = "compiling the ELBO step" if self.compiled else "staying eager"
        saved = self.remaining_steps * self.eager_step_seconds * (1 - 1 / ASSUMED_SPEEDUP)
        return (
            f"compile='auto': {verdict}: {self.remaining_steps:g} planned steps x "
            f"{1e3 * self.eager_step_seconds:.2f} ms eager would save ~{saved:.1f} s at "
            f"{ASSUMED_SPEEDUP:g}x against a compile of {self.compile_seconds:.1f} s ({source})"
        )


class CompileAuto(Callback):
    """Times the first eager steps of a fit, then compiles the ELBO step if it pays.

    Added by :class:`~lightning_dvi.lightning._base.DVIModule` itself under
    ``compile="auto"`` (see the module docstring for the rule).

    Attributes:
        decision: the fit's :class:`CompileDecision` (``None`` until it is taken).
        compile_seconds: the measured compile time, once a compiled step has run.
    """

    def __init__(self, auto: AutoCompile) -> None:
        self.auto = auto
        self.decision: CompileDecision | None = None
        self.compile_seconds: float | None = None
        self._times: list[float] = []
        self._start = 0.0
        self._seen = 0
        self._key = ""
        self._timing_compile = False

    @property
    def state_key(self) -> str:
        """One instance per module (the callback is added by the module)."""
        return "CompileAuto"

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Start eager: a resumed or repeated fit decides again."""
        pl_module._compile = None  # type: ignore[assignment]  # the module's compile options
        pl_module.__dict__.pop("_compiled_elbo_fn", None)
        self.decision, self.compile_seconds, self._times, self._seen = None, None, [], 0

    def on_train_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Start the step's clock."""
        if not self._key:
            self._key = _network_key(pl_module, batch, self.auto.options)
        self._start = time.perf_counter()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Time the step; decide after :data:`MEASURED_STEPS`; time the first compiled step."""
        elapsed = time.perf_counter() - self._start
        self._seen += 1
        if self._timing_compile:
            self._timing_compile = False
            eager = self.decision.eager_step_seconds if self.decision else 0.0
            self.compile_seconds = max(elapsed - eager, 0.0)
            if trainer.is_global_zero:
                _write_time(compile_times_path(), self._key, self.compile_seconds)
            rank_zero_info(f"compile='auto': compiled in {self.compile_seconds:.1f} s")
            return
        if self.decision is not None or self._seen == 1:  # the first step warms up
            return
        self._times.append(elapsed)
        if len(self._times) < MEASURED_STEPS:
            return
        self._decide(trainer, pl_module)

    def _decide(self, trainer: Trainer, pl_module: LightningModule) -> None:
        eager = statistics.median(self._times)
        planned = float(trainer.estimated_stepping_batches)
        remaining = planned - trainer.global_step if math.isfinite(planned) else math.inf
        recorded = _read_times(compile_times_path()).get(self._key)
        expected = DEFAULT_COMPILE_SECONDS if recorded is None else recorded
        compiled = compile_pays(remaining, eager, expected)
        compiled = bool(trainer.strategy.broadcast(compiled, src=0))
        self.decision = CompileDecision(compiled, remaining, eager, expected, recorded is not None)
        rank_zero_info(self.decision.message())
        if compiled:
            pl_module._compile = dict(self.auto.options)  # type: ignore[assignment]  # a DVIModule's options
            self._timing_compile = True
