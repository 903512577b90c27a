r"""The GPU suite: every CUDA path of the package measured in one device call (issue 43).

One command runs, each section in its own forked process with its own time budget under one
global deadline, and writes everything to one JSON file under ``$OUT`` as it goes:

* ``environment``: GPU model, count and memory, driver, torch/CUDA/cuDNN/Triton/Lightning
  versions, the TF32 settings the process started with;
* ``speed``: the speed benchmark's GPU section (:func:`~lightning_dvi_benchmarks.speed_net.net_cell`):
  the 3-layer net ``BayesLinear(d, d)-ReLU-BayesLinear(d, d)-ReLU-BayesLinear(d, 2)`` at
  d = 128-2048, batch 128, forward + backward, for the plain ``torch.nn`` MLP, full DVI, dDVI,
  MCVI with S = 1, 10, 100 and local reparameterisation, eager and compiled (inductor), with
  the peak memory (``torch.cuda.max_memory_allocated``) and the aten ops, host reads and CUDA
  kernels (``torch.profiler``) of one step; plus full DVI at d = 1024 with TF32 matmuls;
* ``uci_fit``: a UCI-size fit, the UCI benchmark's default protocol
  (:func:`~lightning_dvi_benchmarks.uci.run_job`: ``DVIRegressor`` under a Lightning
  ``Trainer(accelerator="gpu")``) on a synthetic 1,000 x 13 table in the UCI layout;
* ``resnet``: one training epoch of 10,000 CIFAR-shaped images (``[3, 32, 32]``, random) of a
  ResNet-18 (width 64, CIFAR stem), whole-network dDVI against the same plain network
  (:mod:`~lightning_dvi_benchmarks.resnet_step`);
* ``cli``: ``lightning-dvi fit --config recipes/csv_regression.yaml`` on a generated CSV with
  ``--trainer.accelerator gpu --trainer.devices 1``, a real subprocess; ``cli_ddp``: the same
  with ``--trainer.strategy ddp`` over every GPU where there are several (skipped on one).

Every section runs strict fp32 (cuBLAS matmuls and cuDNN convolutions at IEEE precision,
whatever the defaults were; the defaults are recorded), except the ``DVI tf32`` cell.

Budgets: a section gets ``min(its budget, time left before the global deadline)`` seconds; its
process is killed (with everything it started) when that runs out, and what it recorded so far
stays in the JSON (status ``"timed out"``). Within the ``speed`` and ``resnet`` sections each
cell (or batch) is skipped when its estimated cost exceeds the time left (status ``"partial"``).
The JSON is rewritten after every section and every second while one runs.

``--dry-run`` runs every section at tiny sizes on the CPU (width 8, a few images, one epoch, no
compiled cells, the CLI called in-process, no DDP): the test suite runs it. Usage::

    python -m lightning_dvi_benchmarks.gpu_suite [--dry-run] [--out DIR]
        [--sections environment,speed,uci_fit,resnet,cli,cli_ddp] [--deadline-s 450]
        [--budget speed=300 ...] [--isolate fork|none]

``recipes/gpu_suite.sh`` installs the carried wheels and runs this on the device machine;
docs/benchmarks.md says how to prepare and launch it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.metadata
import json
import math
import multiprocessing
import os
import platform
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import torch

__all__ = [
    "DRY",
    "FULL",
    "JSON_NAME",
    "SECTIONS",
    "SPEED_METHODS",
    "Plan",
    "Recorder",
    "cli_argv",
    "main",
    "run_sections",
    "tf32",
    "tf32_state",
]

JSON_NAME = "gpu_suite.json"
SPEED_METHODS = (
    "plain MLP",
    "DVI",
    "dDVI",
    "MCVI S=1",
    "MCVI S=10",
    "MCVI S=100",
    "local reparam",
)
"""The speed section's methods (rows of :data:`~lightning_dvi_benchmarks.speed_net.NET_METHODS`)."""

_STATUSES_OK = ("ok", "partial", "skipped")


CELL_KINDS = ("eager", "tf32", "compiled", "cudagraphs")
"""The speed section's kinds of cell, in the order it runs them (``--cells`` chooses some)."""


@dataclass(frozen=True)
class Plan:
    """Sizes and time budgets of one run (:data:`FULL` on a GPU, :data:`DRY` for ``--dry-run``).

    Attributes:
        device: ``"cuda"`` or ``"cpu"``.
        widths: the speed section's widths d.
        batch: its batch size.
        repeats: timed samples per speed cell (fewer when a step takes over a second).
        compile_backend: ``torch.compile`` backend of the compiled cells.
        compiled_methods: methods that get a compiled cell.
        first_compiled: ``(method, d)`` compiled cells run before every other compiled cell
            (the acceptance pairs: compiled dDVI against the compiled plain network).
        tf32_width: width of the ``DVI tf32`` cell.
        cudagraph_cells: ``(method, d)`` cells compiled with ``mode="reduce-overhead"`` (CUDA
            graphs: one replay per step instead of a launch per kernel), labelled
            ``"<method> cudagraphs"``. The dry run compiles them with its own backend, without
            the mode (CUDA graphs need CUDA).
        speed_kinds: the kinds of speed cell to run (:data:`CELL_KINDS`; ``--cells``).
        speed_widths: the widths to run (``None``: every width; ``--widths``).
        uci_rows, uci_features: the synthetic UCI table.
        uci_steps_cap: at most this many L-BFGS steps (``None``: the protocol's own cap).
        resnet_images, resnet_batch, resnet_width, resnet_size, resnet_warmup: the ResNet
            epoch (images per epoch, batch, first-stage channels, image side, warm-up steps).
        cli_rows, cli_epochs: the CLI's generated CSV and ``--trainer.max_epochs``.
        cli_subprocess: run ``lightning-dvi`` as a subprocess (the device run), or call its
            entry point in the section's own (forked) process, which has the imports already
            (the dry run: a new interpreter's imports would be most of its time).
        resnet_peak_memory: measure the ResNet steps' peak memory (``torch.profiler`` on a
            CPU costs seconds for a ResNet step, so the dry run does not).
        budgets: seconds per section.
        deadline_s: the global deadline, seconds after the start.
    """

    device: str
    widths: tuple[int, ...]
    batch: int
    repeats: int
    compile_backend: str
    compiled_methods: tuple[str, ...]
    first_compiled: tuple[tuple[str, int], ...]
    tf32_width: int
    uci_rows: int
    uci_features: int
    uci_steps_cap: int | None
    resnet_images: int
    resnet_batch: int
    resnet_width: int
    resnet_size: int
    resnet_warmup: int
    cli_rows: int
    cli_epochs: int
    cli_subprocess: bool = True
    resnet_peak_memory: bool = True
    cudagraph_cells: tuple[tuple[str, int], ...] = ()
    speed_kinds: tuple[str, ...] = CELL_KINDS
    speed_widths: tuple[int, ...] | None = None
    budgets: Mapping[str, float] = field(default_factory=dict)
    deadline_s: float = 450.0


FULL = Plan(
    device="cuda",
    widths=(128, 256, 512, 1024, 2048),
    batch=128,
    repeats=11,
    compile_backend="inductor",
    compiled_methods=SPEED_METHODS,
    first_compiled=tuple((m, d) for d in (128, 256, 512, 1024) for m in ("plain MLP", "dDVI")),
    tf32_width=1024,
    cudagraph_cells=tuple((m, d) for d in (128, 512, 1024) for m in ("plain MLP", "dDVI")),
    uci_rows=1000,
    uci_features=13,
    uci_steps_cap=150,
    resnet_images=10_000,
    resnet_batch=128,
    resnet_width=64,
    resnet_size=32,
    resnet_warmup=3,
    cli_rows=1000,
    cli_epochs=5,
    budgets={
        "environment": 30,
        "speed": 280,
        "uci_fit": 40,
        "resnet": 60,
        "cli": 45,
        "cli_ddp": 45,
    },
    deadline_s=450.0,
)
"""The device run: about 7.5 minutes at most, inside issue 43's 8 (the wheels' install aside)."""

DRY = Plan(
    device="cpu",
    widths=(8,),
    batch=4,
    repeats=1,
    compile_backend="eager",
    compiled_methods=(),
    first_compiled=(),
    tf32_width=8,
    cudagraph_cells=(("dDVI", 8),),
    uci_rows=60,
    uci_features=13,
    uci_steps_cap=2,
    resnet_images=8,
    resnet_batch=4,
    resnet_width=4,
    resnet_size=8,
    resnet_warmup=1,
    cli_rows=60,
    cli_epochs=1,
    cli_subprocess=False,
    resnet_peak_memory=False,
    budgets={
        "environment": 60,
        "speed": 120,
        "uci_fit": 60,
        "resnet": 60,
        "cli": 120,
        "cli_ddp": 60,
    },
    deadline_s=300.0,
)
"""``--dry-run``: every section at tiny sizes on the CPU (the test suite runs it)."""


# ----------------------------------------------------------------------------- recording
def _jsonable(value: Any) -> Any:
    """``value`` as strict JSON: tuples as lists, non-finite floats as ``"nan"``/``"inf"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` atomically (a reader never sees half a file)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(_jsonable(data), indent=1, allow_nan=False))
    os.replace(tmp, path)


class Recorder:
    """What one section records, saved to ``path`` after every :meth:`set` (partial results).

    Attributes:
        data: the section's results (``"status"`` may be set to ``"partial"``/``"skipped"``).
        deadline: ``time.monotonic()`` value at which the section's budget runs out.
    """

    def __init__(self, path: Path | None, deadline: float) -> None:
        self.data: dict[str, Any] = {}
        self.path = path
        self.deadline = deadline

    def time_left(self) -> float:
        """Seconds left of the section's budget."""
        return self.deadline - time.monotonic()

    def set(self, key: str, value: Any) -> None:
        """Record ``key`` and save."""
        self.data[key] = value
        self.save()

    def save(self) -> None:
        """Write :attr:`data` to the partial file (if any)."""
        if self.path is not None:
            _write_json(self.path, self.data)


# ---------------------------------------------------------------------------- precision
def tf32_state() -> dict[str, Any]:
    """The process's TF32 settings: cuBLAS matmuls and cuDNN convolutions.

    torch >= 2.9 reports ``fp32_precision`` (``"ieee"``, ``"tf32"`` or ``"none"``: inherit);
    older versions the ``allow_tf32`` flags. No CUDA initialisation.
    """
    backends = torch.backends
    cudnn: Any = backends.cudnn  # its `conv` sub-module (torch >= 2.9) is not in the stubs
    state: dict[str, Any] = {"float32_matmul_precision": torch.get_float32_matmul_precision()}
    if hasattr(backends.cuda.matmul, "fp32_precision"):
        state["matmul fp32_precision"] = backends.cuda.matmul.fp32_precision
        state["cudnn conv fp32_precision"] = cudnn.conv.fp32_precision
    else:  # pragma: no cover - torch < 2.9
        state["matmul allow_tf32"] = backends.cuda.matmul.allow_tf32
        state["cudnn allow_tf32"] = backends.cudnn.allow_tf32
    return state


def _set_tf32(allowed: bool) -> None:
    backends = torch.backends
    cudnn: Any = backends.cudnn  # its `conv` sub-module (torch >= 2.9) is not in the stubs
    if hasattr(backends.cuda.matmul, "fp32_precision"):
        value = "tf32" if allowed else "ieee"
        backends.cuda.matmul.fp32_precision = value
        cudnn.conv.fp32_precision = value
    else:  # pragma: no cover - torch < 2.9
        backends.cuda.matmul.allow_tf32 = allowed
        backends.cudnn.allow_tf32 = allowed


@contextlib.contextmanager
def tf32(allowed: bool) -> Iterator[None]:
    """TF32 matmuls and convolutions on (``allowed``) or off (strict fp32) inside the block."""
    backends = torch.backends
    cudnn: Any = backends.cudnn  # its `conv` sub-module (torch >= 2.9) is not in the stubs
    new_api = hasattr(backends.cuda.matmul, "fp32_precision")
    if new_api:
        saved: tuple[Any, ...] = (
            backends.cuda.matmul.fp32_precision,
            cudnn.conv.fp32_precision,
        )
    else:  # pragma: no cover - torch < 2.9
        saved = (backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32)
    _set_tf32(allowed)
    try:
        yield
    finally:
        if new_api:
            backends.cuda.matmul.fp32_precision, cudnn.conv.fp32_precision = saved
        else:  # pragma: no cover - torch < 2.9
            backends.cuda.matmul.allow_tf32, backends.cudnn.allow_tf32 = saved


# ----------------------------------------------------------------------------- sections
def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def section_environment(plan: Plan, rec: Recorder) -> None:
    """The machine: GPU(s), driver, library versions (the TF32 defaults are the parent's)."""
    from .timing import machine

    device = torch.device(plan.device)
    rec.data.update(machine(device))
    rec.data["cuda"] = torch.version.cuda
    rec.data["cudnn"] = (
        torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    )
    rec.data["gpu_count"] = torch.cuda.device_count() if plan.device == "cuda" else 0
    gpus = []
    for i in range(rec.data["gpu_count"]):
        props = torch.cuda.get_device_properties(i)
        gpus.append({
            "name": props.name, "capability": f"{props.major}.{props.minor}",
            "memory GiB": props.total_memory / 2**30, "multiprocessors": props.multi_processor_count,
        })  # fmt: skip
    rec.data["gpus"] = gpus
    rec.data["versions"] = {
        name: _version(name)
        for name in ("torch", "triton", "lightning", "torchmetrics", "jsonargparse", "pyro-ppl",
                     "pyarrow", "numpy", "lightning_dvi")
    }  # fmt: skip
    rec.data["tf32 in the sections"] = tf32_state()
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        query = "name,driver_version,memory.total,clocks.max.sm,power.limit"
        out = subprocess.run(
            [smi, f"--query-gpu={query}", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=max(1.0, min(20.0, rec.time_left())),
        )  # fmt: skip
        rec.data["nvidia-smi"] = {"query": query, "rows": out.stdout.strip().splitlines()}
    rec.save()


def _speed_cells(
    plan: Plan, kinds: Sequence[str] = CELL_KINDS, widths: Sequence[int] | None = None
) -> list[tuple[str, int, str]]:
    """``(method, d, kind)`` in the order the speed section runs them.

    Every eager cell, width by width; the TF32 cell; :attr:`Plan.first_compiled`; the CUDA-graph
    cells; the other compiled cells, width by width. ``kinds`` and ``widths`` (``None``: all)
    keep a subset, for a second run that measures only what changed.
    """
    cells = [(m, d, "eager") for d in plan.widths for m in SPEED_METHODS]
    cells.append(("DVI", plan.tf32_width, "tf32"))
    cells += [(m, d, "compiled") for m, d in plan.first_compiled]
    cells += [(m, d, "cudagraphs") for m, d in plan.cudagraph_cells]
    cells += [
        (m, d, "compiled")
        for d in plan.widths
        for m in SPEED_METHODS
        if m in plan.compiled_methods and (m, d) not in plan.first_compiled
    ]
    return [c for c in cells if c[2] in kinds and (widths is None or c[1] in widths)]


def _estimate(previous: tuple[int, float, float] | None, d: int, method: str) -> float:
    """Seconds a cell at width ``d`` should take, from the same label at a smaller width.

    ``previous = (d0, first-call seconds, other seconds)``: the first call (compilation, Triton
    autotuning of the eager kernels, lazy initialisation) is counted once, the other seconds scale as
    :math:`(d/d_0)^3` for full DVI (its ``[B, d, d]`` covariance products) and
    :math:`(d/d_0)^2` for the rest (weights), an upper bound where kernels are launch-bound.
    """
    if previous is None:
        return 0.0
    d0, compile_s, other = previous
    power = 3 if method == "DVI" else 2
    return compile_s + other * (d / d0) ** power


def section_speed(plan: Plan, rec: Recorder) -> None:
    """The speed benchmark's GPU section, cell by cell, within the budget."""
    from . import speed as S
    from .speed_net import net_cell

    S.DEVICE = torch.device(plan.device)
    cells = _speed_cells(plan, plan.speed_kinds, plan.speed_widths)
    rows: dict[int, dict[str, Any]] = {
        d: {"d": d, "batch": plan.batch} for d in sorted({d for _, d, _ in cells})
    }
    rec.data.update({
        "rows": list(rows.values()), "batch": plan.batch, "repeats": plan.repeats,
        "compile": {"backend": plan.compile_backend}, "skipped": [],
    })  # fmt: skip
    rec.save()
    seen: dict[str, tuple[int, float, float]] = {}
    first_s: dict[str, float] = {}
    for method, d, kind in cells:
        label = method if kind == "eager" else f"{method} {kind}"
        estimate = _estimate(seen.get(label), d, method)
        if estimate > rec.time_left():
            rows[d][label] = f"skipped: about {estimate:.0f} s, {rec.time_left():.0f} s left"
            rec.data["skipped"].append([label, d])
            rec.data["status"] = "partial"
            rec.save()
            continue
        start = time.perf_counter()
        opts: dict[str, Any] | None = None
        if kind in ("compiled", "cudagraphs"):
            opts = {"backend": plan.compile_backend}
            if kind == "cudagraphs" and plan.compile_backend == "inductor":
                opts["mode"] = "reduce-overhead"
        try:
            with tf32(kind == "tf32"):
                cell = net_cell(method, d, plan.batch, plan.repeats, opts,
                                count=first_s.get(label, 0.0) < 1.0)  # fmt: skip
        except Exception as err:  # out of memory, a compiler error: recorded, the rest runs
            cell = {label: f"failed: {type(err).__name__}: {str(err)[:300]}"}
        if kind in ("tf32", "cudagraphs"):  # net_cell labels the cell "method [compiled]"
            made = method + (" compiled" if opts is not None else "")
            cell = {label + k[len(made) :] if k.startswith(made) else k: v
                    for k, v in cell.items()}  # fmt: skip
        rows[d].update(cell)
        elapsed = time.perf_counter() - start
        # the first call (compilation; Triton autotuning in eager cells too) does not scale with d
        once = float(cell.get(label + " first s", 0.0))
        seen[label] = (d, once, max(0.0, elapsed - once))
        first_s[label] = float(cell.get(label + " first s", 0.0))
        rec.save()
    S.DEVICE = torch.device("cpu")


def _synthetic_table(rows: int, features: int, seed: int = 0) -> tuple[Any, Any]:
    """A heteroscedastic regression table: ``x ~ N(0, I)``, ``y = f(x) + s(x) * noise``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, features))
    w = rng.standard_normal(features) / math.sqrt(features)
    mean = x @ w + 0.5 * np.sin(2.0 * x[:, 0])
    y = mean + (0.2 + 0.3 * np.abs(np.tanh(x[:, 1]))) * rng.standard_normal(rows)
    return x, y


def _write_uci_layout(folder: Path, rows: int, features: int) -> None:
    """The synthetic table in the UCI layout (one split, 90 % training rows)."""
    import numpy as np

    x, y = _synthetic_table(rows, features)
    folder.mkdir(parents=True)
    np.savetxt(folder / "data.txt", np.column_stack([x, y]), fmt="%.6f")
    np.savetxt(folder / "index_features.txt", np.arange(features), fmt="%d")
    np.savetxt(folder / "index_target.txt", np.array([features]), fmt="%d")
    order = np.random.default_rng(1).permutation(rows)
    n_train = int(0.9 * rows)
    np.savetxt(folder / "index_train_0.txt", np.sort(order[:n_train]), fmt="%d")
    np.savetxt(folder / "index_test_0.txt", np.sort(order[n_train:]), fmt="%d")


def section_uci_fit(plan: Plan, rec: Recorder) -> None:
    """A UCI-size fit: the UCI benchmark's default protocol, full DVI, on a synthetic table."""
    from .uci import DEFAULTS, Job, run_job

    with tempfile.TemporaryDirectory(prefix="gpu_suite_uci_") as tmp:
        _write_uci_layout(Path(tmp) / "synthetic", plan.uci_rows, plan.uci_features)
        accelerator: Literal["cpu", "gpu"] = "gpu" if plan.device == "cuda" else "cpu"
        job = Job(tmp, "synthetic", "dvi", 0, 50, 0.0, plan.uci_steps_cap, DEFAULTS)
        rec.data.update({
            "table": f"synthetic {plan.uci_rows} x {plan.uci_features}, 90 % training rows",
            "method": "dvi (full, heteroscedastic, empirical Bayes), hidden 50",
            "protocol": "benchmarks.uci DEFAULTS (point warm start, L-BFGS, early stopping)",
            "accelerator": accelerator, "steps_cap": plan.uci_steps_cap,
        })  # fmt: skip
        rec.save()
        result = run_job(job, accelerator)
    rec.data.update(result)
    rec.save()


def section_resnet(plan: Plan, rec: Recorder) -> None:
    """One epoch of a ResNet-18 on CIFAR-shaped random images: plain against dDVI."""
    from .resnet_step import ddvi_step, deterministic_step, resnet_pair
    from .timing import clock, count_dispatch, peak_memory_mib

    device = torch.device(plan.device)
    n, b = plan.resnet_images, plan.resnet_batch
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, plan.resnet_size, plan.resnet_size, generator=gen).to(device)
    y = torch.randint(0, 10, (n,), generator=gen).to(device)
    plain, bayes = resnet_pair(x[:b], plan.resnet_width)
    steps = {"plain": deterministic_step(plain), "dDVI": ddvi_step(bayes, device=device)}
    rec.data.update({
        "images": n, "batch": b, "width": plan.resnet_width,
        "shape": [3, plan.resnet_size, plan.resnet_size],
        "dDVI": "from_torch(resnet18), every weight layer Bayesian, BatchNorm on running statistics",
    })  # fmt: skip
    rec.save()
    xb, yb = x[:b], y[:b]
    for name, step in steps.items():
        for _ in range(plan.resnet_warmup):
            step(xb, yb)
        if plan.resnet_peak_memory:
            rec.data[name + " peak MiB"] = peak_memory_mib(functools.partial(step, xb, yb), device)
        rec.data[name + " ops"] = count_dispatch(
            functools.partial(step, xb, yb), device.type == "cuda"
        )
        rec.save()
        done, start = 0, clock(device)
        while done < n:
            elapsed = clock(device) - start
            if done and elapsed / done * min(b, n - done) > rec.time_left():
                rec.data["status"] = "partial"
                break
            step(x[done : done + b], y[done : done + b])
            done += min(b, n - done)
        seconds = clock(device) - start
        rec.data[name + " images"] = done
        rec.data[name + " epoch s"] = seconds * n / done
        rec.data[name + " measured s"] = seconds
        rec.save()
    rec.data["dDVI / plain"] = rec.data["dDVI epoch s"] / rec.data["plain epoch s"]
    rec.data["dDVI s per 50,000 images"] = rec.data["dDVI epoch s"] * 50_000 / n
    rec.save()


def _recipe(name: str) -> Path:
    """``recipes/<name>`` of the checkout the package (or the current directory) is in."""
    import lightning_dvi

    for root in (Path(lightning_dvi.__file__).resolve().parents[1], Path.cwd()):
        path = root / "recipes" / name
        if path.is_file():
            return path
    raise FileNotFoundError(f"recipes/{name} not found next to the package or in {Path.cwd()}")


def _cli_command() -> list[str]:
    """The ``lightning-dvi`` console script of this interpreter, else ``python -m lightning_dvi.cli``."""
    script = Path(sys.executable).with_name("lightning-dvi")
    if script.is_file():
        return [str(script)]
    found = shutil.which("lightning-dvi")
    return [found] if found is not None else [sys.executable, "-m", "lightning_dvi.cli"]


def cli_argv(csv: Path, recipe: Path, accelerator: str, devices: int, epochs: int,
             ddp: bool = False) -> list[str]:  # fmt: skip
    """The ``lightning-dvi`` arguments of the CLI sections (the command is :func:`_cli_command`)."""
    argv = [
        "fit", "--config", str(recipe), "--data.path", str(csv),
        "--trainer.accelerator", accelerator, "--trainer.devices", str(devices),
        "--trainer.max_epochs", str(epochs),
    ]  # fmt: skip
    if ddp:
        argv += ["--trainer.strategy", "ddp"]
    return argv


def _last_metrics(run_dir: Path) -> dict[str, float]:
    """The last logged value of every column of the run's ``metrics.csv``."""
    import csv

    found = sorted(run_dir.glob("runs/*/lightning_logs/version_*/metrics.csv"))
    if not found:
        return {}
    last: dict[str, float] = {}
    with found[-1].open() as fh:
        for row in csv.DictReader(fh):
            last.update({k: float(v) for k, v in row.items() if v not in ("", None)})
    return last


def _run_cli(plan: Plan, rec: Recorder, ddp: bool) -> None:
    import numpy as np

    devices = 1
    if ddp:
        devices = torch.cuda.device_count() if plan.device == "cuda" else 0
        if devices < 2:
            rec.data.update({"status": "skipped", "reason": f"{devices} GPU(s): DDP needs two"})
            rec.save()
            return
    accelerator = "gpu" if plan.device == "cuda" else "cpu"
    with tempfile.TemporaryDirectory(prefix="gpu_suite_cli_") as tmp:
        x, y = _synthetic_table(plan.cli_rows, plan.uci_features, seed=2)
        names = [f"x{i}" for i in range(x.shape[1])] + ["target"]
        csv = Path(tmp) / "table.csv"
        np.savetxt(csv, np.column_stack([x, y]), fmt="%.6f", delimiter=",",
                   header=",".join(names), comments="")  # fmt: skip
        argv = cli_argv(csv, _recipe("csv_regression.yaml"), accelerator, devices,
                        plan.cli_epochs, ddp)  # fmt: skip
        rec.data["command"] = shlex.join(["lightning-dvi", *argv])
        rec.data["launched"] = "subprocess" if plan.cli_subprocess else "in-process"
        rec.save()
        start = time.perf_counter()
        if plan.cli_subprocess:
            returncode, stderr = _cli_subprocess(argv, Path(tmp), rec.time_left() - 2.0)
        else:
            returncode, stderr = _cli_in_process(argv, Path(tmp))
        rec.data["run s"] = time.perf_counter() - start
        rec.data["returncode"] = returncode
        metrics = _last_metrics(Path(tmp))
        rec.data["metrics"] = {k: v for k, v in metrics.items() if "/" in k}
        if returncode != 0:
            rec.data["stderr tail"] = stderr[-3000:]
            rec.save()
            raise RuntimeError(f"lightning-dvi exited with {returncode}")
    rec.save()


def _cli_subprocess(argv: list[str], cwd: Path, timeout: float) -> tuple[int, str]:
    """``lightning-dvi ARGV`` in ``cwd``, this checkout first on ``PYTHONPATH``: ``(rc, stderr)``."""
    import lightning_dvi

    env = dict(os.environ)
    root = str(Path(lightning_dvi.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("MPLBACKEND", "Agg")
    result = subprocess.run([*_cli_command(), *argv], cwd=cwd, env=env, capture_output=True,
                            text=True, timeout=max(1.0, timeout))  # fmt: skip
    return result.returncode, result.stderr


def _cli_in_process(argv: list[str], cwd: Path) -> tuple[int, str]:
    """``lightning_dvi.cli.main(ARGV)`` with ``cwd`` as the working directory: ``(rc, error)``."""
    from lightning_dvi.cli import main as cli_main

    here, saved_argv = Path.cwd(), sys.argv
    os.chdir(cwd)
    sys.argv = ["lightning-dvi"]  # LightningCLI warns when given args and a command line both
    try:
        cli_main(argv)
    except SystemExit as err:  # a configuration error exits through jsonargparse
        code = err.code if isinstance(err.code, int) else 1
        return code, f"SystemExit({err.code!r})"
    finally:
        os.chdir(here)
        sys.argv = saved_argv
    return 0, ""


def section_cli(plan: Plan, rec: Recorder) -> None:
    """``lightning-dvi fit`` on a generated CSV, ``Trainer(accelerator="gpu", devices=1)``."""
    _run_cli(plan, rec, ddp=False)


def section_cli_ddp(plan: Plan, rec: Recorder) -> None:
    """The same with ``strategy="ddp"`` over every GPU; skipped with fewer than two."""
    _run_cli(plan, rec, ddp=True)


Section = Callable[[Plan, Recorder], None]
SECTIONS: dict[str, Section] = {
    "environment": section_environment,
    "speed": section_speed,
    "uci_fit": section_uci_fit,
    "resnet": section_resnet,
    "cli": section_cli,
    "cli_ddp": section_cli_ddp,
}
"""The sections, in the order they run."""


# ------------------------------------------------------------------------------ running
def _child(fn: Section, plan: Plan, path: Path, deadline: float) -> None:
    """Body of a section's process: its own process group, strict fp32, errors recorded."""
    os.setpgrp()  # the parent kills the whole group: compile workers, the CLI, DDP ranks
    if plan.device == "cpu":
        torch.set_num_threads(1)
    rec = Recorder(path, deadline)
    try:
        with tf32(False):
            fn(plan, rec)
    except BaseException as err:
        rec.data["error"] = f"{type(err).__name__}: {err}"
        rec.data["traceback"] = traceback.format_exc()[-4000:]
        rec.save()
        os._exit(1)
    rec.save()


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _read_partial(path: Path) -> dict[str, Any]:
    try:
        data: dict[str, Any] = json.loads(path.read_text())
        return data
    except (OSError, ValueError):
        return {}


def _run_forked(
    fn: Section,
    plan: Plan,
    limit: float,
    partial: Path,
    on_progress: Callable[[dict[str, Any]], None],
) -> tuple[str, dict[str, Any]]:
    """Run one section in a forked process for at most ``limit`` seconds: ``(status, data)``."""
    if torch.cuda.is_initialized():
        raise RuntimeError("the suite's parent process initialised CUDA: sections cannot fork")
    ctx = multiprocessing.get_context("fork")
    deadline = time.monotonic() + limit
    proc = ctx.Process(target=_child, args=(fn, plan, partial, deadline), daemon=False)
    with warnings.catch_warnings():  # Python 3.12 warns on fork() with threads alive
        warnings.simplefilter("ignore", DeprecationWarning)
        proc.start()
    assert proc.pid is not None
    mtime = 0.0
    while proc.is_alive() and time.monotonic() < deadline:
        proc.join(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        with contextlib.suppress(OSError):
            if partial.stat().st_mtime != mtime:
                mtime = partial.stat().st_mtime
                on_progress(_read_partial(partial))
    timed_out = proc.is_alive()
    _kill_group(proc.pid)  # also whatever a finished section left running
    proc.join()
    data = _read_partial(partial)
    if timed_out:
        return "timed out", data
    if proc.exitcode != 0:
        data.setdefault("error", f"the section's process exited with {proc.exitcode}")
        return "failed", data
    return str(data.pop("status", "ok")), data


def _run_inline(fn: Section, plan: Plan, limit: float) -> tuple[str, dict[str, Any]]:
    """Run one section in this process (``--isolate none``: budgets are only cooperative)."""
    rec = Recorder(None, time.monotonic() + limit)
    try:
        with tf32(False):
            fn(plan, rec)
    except Exception as err:
        rec.data["error"] = f"{type(err).__name__}: {err}"
        rec.data["traceback"] = traceback.format_exc()[-4000:]
        return "failed", rec.data
    return str(rec.data.pop("status", "ok")), rec.data


def run_sections(
    sections: Mapping[str, Section],
    plan: Plan,
    result: dict[str, Any],
    out: Path,
    deadline_s: float | None = None,
    isolate: str = "fork",
) -> dict[str, Any]:
    """Run ``sections`` in order into ``result["sections"]``, rewriting ``out`` as they go.

    Each section gets ``min(plan.budgets[name], time left before the deadline)`` seconds
    (a section without a budget: the time left); past the deadline the rest are ``"skipped"``.

    Returns:
        ``result``, with ``result["sections"][name] = {"status", "section s", "budget_s", ...}``:
        status ``"ok"``, ``"partial"`` (cells skipped to keep the budget), ``"skipped"``,
        ``"timed out"`` (killed at the budget) or ``"failed"`` (``"error"`` says why).
    """
    start = time.monotonic()
    deadline = start + (plan.deadline_s if deadline_s is None else deadline_s)
    result.setdefault("sections", {})
    with tempfile.TemporaryDirectory(prefix="gpu_suite_") as scratch:
        for name, fn in sections.items():
            left = deadline - time.monotonic() - 1.0
            limit = min(plan.budgets.get(name, left), left)
            entry: dict[str, Any] = {"status": "running", "budget_s": limit}
            result["sections"][name] = entry
            if limit < 2.0:
                entry.update({"status": "skipped", "reason": "global deadline reached"})
                _write_json(out, result)
                continue
            _write_json(out, result)
            t0 = time.monotonic()

            def progress(data: dict[str, Any], entry: dict[str, Any] = entry) -> None:
                entry.update(data)
                _write_json(out, result)

            if isolate == "fork":
                partial = Path(scratch) / f"{name}.json"
                status, data = _run_forked(fn, plan, limit, partial, progress)
            else:
                status, data = _run_inline(fn, plan, limit)
            entry.update(data)
            entry.update({"status": status, "section s": time.monotonic() - t0})
            _write_json(out, result)
            print(f"[gpu_suite] {name}: {status} in {entry['section s']:.1f} s", flush=True)
    return result


# ---------------------------------------------------------------------------- reporting
def _git_commit(root: Path | None = None) -> dict[str, str]:
    """The commit being measured: ``git`` if ``root`` is a checkout's top level, else ``wheels/COMMIT``.

    ``root`` defaults to the folder holding the imported ``lightning_dvi``. A copy made by ``git
    archive`` inside another repository (a device call that carries a clean tree) is not that
    repository's checkout: its ``wheels/COMMIT`` names what was copied.
    """
    if root is None:
        import lightning_dvi

        root = Path(lightning_dvi.__file__).resolve().parents[1]
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel", "HEAD"],
                             capture_output=True, text=True, timeout=10)  # fmt: skip
        lines = top.stdout.split()
        if top.returncode == 0 and len(lines) == 2 and Path(lines[0]).resolve() == root.resolve():
            dirty = subprocess.run(
                ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()  # fmt: skip
            return {"commit": lines[1], "source": "git",
                    "uncommitted changes": "yes" if dirty else "no"}  # fmt: skip
    for folder in (root, Path.cwd()):
        stamp = folder / "wheels" / "COMMIT"
        if stamp.is_file():
            return {"commit": stamp.read_text().strip(), "source": str(stamp)}
    return {"commit": "unknown", "source": "no git, no wheels/COMMIT"}


def acceptance(result: Mapping[str, Any]) -> dict[str, Any]:
    """Issue 43's targets read off the results (``None`` where a figure is missing)."""
    sections = result.get("sections", {})
    rows = {row["d"]: row for row in sections.get("speed", {}).get("rows", [])}

    def ratio(d: int, num: str, den: str) -> float | None:
        a, b = rows.get(d, {}).get(num), rows.get(d, {}).get(den)
        ok = isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0
        return float(a) / float(b) if ok else None

    out: dict[str, Any] = {}
    if rows:
        big = max(d for d in rows if d <= 1024) if any(d <= 1024 for d in rows) else min(rows)
        out[f"DVI / MCVI S=100 at d={big} (target <= 1)"] = ratio(big, "DVI", "MCVI S=100")
        out[f"DVI tf32 / MCVI S=100 at d={big} (target <= 1)"] = ratio(
            big, "DVI tf32", "MCVI S=100"
        )
        for d in sorted(rows):
            if d <= 1024:
                out[f"dDVI compiled / plain MLP compiled at d={d} (target <= 2)"] = ratio(
                    d, "dDVI compiled", "plain MLP compiled"
                )
                graphs = ratio(d, "dDVI cudagraphs", "plain MLP cudagraphs")
                if graphs is not None:
                    out[f"dDVI / plain MLP, both with CUDA graphs, at d={d} (target <= 2)"] = graphs
    resnet = sections.get("resnet", {})
    out["ResNet-18 dDVI / plain epoch (target <= 3)"] = resnet.get("dDVI / plain")
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "-" if value is None else str(value)


def summary(result: Mapping[str, Any]) -> str:
    """The printed summary: one line per section, the speed tables, the acceptance ratios."""
    from .speed_net import report_net
    from .timing import markdown_table

    sections = result.get("sections", {})
    lines = [f"\n# GPU suite ({'dry run, CPU' if result.get('dry_run') else 'device'}), "
             f"commit {result.get('commit', {}).get('commit')}\n"]  # fmt: skip
    env = sections.get("environment", {})
    lines.append(
        f"GPU: {env.get('gpu', 'none')} x {env.get('gpu_count', 0)}; torch {env.get('torch')}, "
        f"CUDA {env.get('cuda')}; TF32 at start: {result.get('tf32 at start')}; sections run "
        "strict fp32\n"
    )
    keys = {
        "environment": ("gpu",),
        "speed": ("skipped",),
        "uci_fit": ("test_ll", "rmse", "seconds", "steps"),
        "resnet": ("plain epoch s", "dDVI epoch s", "dDVI / plain"),
        "cli": ("returncode", "run s", "test/nll"),
        "cli_ddp": ("returncode", "run s", "test/nll", "reason"),
    }
    table = []
    for name, entry in sections.items():
        values = {**entry.get("metrics", {}), **entry}
        figures = "; ".join(f"{k} {_fmt(values[k])}" for k in keys.get(name, ()) if k in values)
        if "error" in entry:
            figures += f" error: {str(entry['error'])[:120]}"
        table.append({"section": name, "status": entry.get("status"),
                      "s": entry.get("section s"), "budget s": entry.get("budget_s"),
                      "figures": figures})  # fmt: skip
    lines.append(markdown_table(table, ["section", "status", "s", "budget s", "figures"], "{:.1f}"))
    speed = sections.get("speed", {})
    if speed.get("rows"):
        lines.append(report_net(speed["rows"], speed.get("batch", 0), True, True))
        graphs = sorted({k for row in speed["rows"] for k in row if k.endswith(" cudagraphs")})
        if graphs:
            from .speed import table as speed_table

            lines.append('\n## Compiled with CUDA graphs (mode="reduce-overhead"; ms, median)\n')
            lines.append(speed_table(speed["rows"], ["d", *graphs]))
    lines.append("\n## Acceptance (issue 43)\n")
    lines += [f"- {k}: {_fmt(v)}" for k, v in result.get("acceptance", {}).items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (1 if a section failed or timed out)."""
    parser = argparse.ArgumentParser(
        prog="python -m lightning_dvi_benchmarks.gpu_suite",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes on the CPU")
    parser.add_argument(
        "--out",
        default=os.environ.get("OUT") or "outputs/gpu_suite",
        help=f"folder for {JSON_NAME} (default: $OUT, else outputs/gpu_suite)",
    )
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated")
    parser.add_argument("--deadline-s", type=float, default=None, help="global deadline")
    parser.add_argument(
        "--budget", action="append", default=[], metavar="SECTION=SECONDS",
        help="override one section's budget (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--cells", default=",".join(CELL_KINDS),
        help=f"speed cells to run, comma-separated kinds of {', '.join(CELL_KINDS)}",
    )  # fmt: skip
    parser.add_argument(
        "--widths", default=None, help="speed widths to run, comma-separated (default: all)"
    )
    parser.add_argument(
        "--isolate", choices=("fork", "none"), default="fork",
        help="fork: each section in its own killable process (default); none: in this one",
    )  # fmt: skip
    args = parser.parse_args(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in wanted if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")
    plan = DRY if args.dry_run else FULL
    budgets = dict(plan.budgets)
    for item in args.budget:
        name, _, seconds = item.partition("=")
        if name not in SECTIONS or not seconds:
            parser.error(f"--budget {item!r}: expected SECTION=SECONDS with SECTION in "
                         f"{', '.join(SECTIONS)}")  # fmt: skip
        try:
            budgets[name] = float(seconds)
        except ValueError:
            parser.error(f"--budget {item!r}: {seconds!r} is not a number of seconds")
        if not budgets[name] > 0:
            parser.error(f"--budget {item!r}: the budget must be positive")
    if args.deadline_s is not None and not args.deadline_s > 0:
        parser.error("--deadline-s must be positive")
    kinds = tuple(k.strip() for k in args.cells.split(",") if k.strip())
    if not kinds or any(k not in CELL_KINDS for k in kinds):
        parser.error(f"--cells {args.cells!r}: choose from {', '.join(CELL_KINDS)}")
    widths: tuple[int, ...] | None = None
    if args.widths is not None:
        try:
            widths = tuple(int(w) for w in args.widths.split(",") if w.strip())
        except ValueError:
            parser.error(f"--widths {args.widths!r}: expected comma-separated integers")
        if not widths or any(w <= 0 for w in widths):
            parser.error(f"--widths {args.widths!r}: expected positive widths")
    plan = replace(
        plan, budgets=budgets, deadline_s=args.deadline_s or plan.deadline_s,
        speed_kinds=kinds, speed_widths=widths,
    )  # fmt: skip
    if plan.device == "cuda" and args.isolate == "fork" and torch.cuda.is_initialized():
        parser.error("CUDA is already initialised in this process: use --isolate none")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / JSON_NAME
    result: dict[str, Any] = {
        "suite": "lightning_dvi_benchmarks.gpu_suite",
        "dry_run": bool(args.dry_run),
        "argv": list(sys.argv[1:] if argv is None else argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %z"),
        "commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "tf32 at start": tf32_state(),
        "precision": "strict fp32 (matmul and cuDNN conv at IEEE fp32) except the 'DVI tf32' cell",
        "plan": asdict(plan),
    }
    # The sections fork from this process, so it must not initialise CUDA. torch.cuda's default
    # availability check (CUDA runtime) is not fork-safe, its NVML check is: any library calling
    # torch.cuda.is_available() here (on import, say) then leaves the forked sections usable.
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    # Import what the sections use once, here (no CUDA initialisation): forked sections inherit
    # it. A missing dependency shows up as the failing section's error instead.
    for module in ("lightning_dvi_benchmarks.speed_net", "lightning_dvi.lightning",
                   "lightning_dvi_benchmarks.uci", "lightning_dvi_benchmarks.resnet_step",
                   "lightning_dvi.cli"):  # fmt: skip
        with contextlib.suppress(ImportError):
            importlib.import_module(module)
    start = time.monotonic()
    run_sections({s: SECTIONS[s] for s in wanted}, plan, result, out, isolate=args.isolate)
    result["total_s"] = time.monotonic() - start
    result["finished"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    result["acceptance"] = acceptance(result)
    _write_json(out, result)
    print(summary(result))
    print(f"\n[gpu_suite] wrote {out}")
    bad = [n for n, e in result["sections"].items() if e.get("status") not in _STATUSES_OK]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
