r"""The timing harness of the speed benchmarks: CPU-time medians, interleaved A/B, op counts, memory.

Honest numbers on a shared machine need three things this module does once:

* **CPU time, not wall time, on a CPU** (:func:`clock`): with one thread it equals wall time on
  an idle machine, and it does not count the time other processes hold the core. On CUDA, wall
  time between ``torch.cuda.synchronize()`` calls (kernels run asynchronously).
* **Medians of many short samples** (:func:`time_call`), each sample long enough (about 5 ms)
  for the clock's resolution, after warm-up calls.
* **Interleaving** (:func:`interleaved`, :func:`ratio`): cells compared with each other run
  round-robin in one process, so machine load hits them alike, and a ratio is the median of
  per-round ratios, in which the load cancels.

Counts that do not depend on the load explain the times: aten ops, non-view ops and host reads
per call (:func:`count_dispatch`), subnormal values produced (:func:`count_subnormals`), and
the peak memory a call adds (:func:`peak_memory_mib`). :func:`machine` records where a number
was measured; :func:`markdown_table` prints rows.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "clock",
    "count_cuda_kernels",
    "count_dispatch",
    "count_ops",
    "count_subnormals",
    "interleaved",
    "machine",
    "markdown_table",
    "peak_memory_mib",
    "ratio",
    "time_call",
]

_CPU = torch.device("cpu")


def clock(device: torch.device = _CPU) -> float:
    """Process CPU seconds on a CPU; wall seconds after a device synchronisation on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def time_call(
    fn: Callable[[], Any], repeats: int = 15, warmup: int = 3, device: torch.device = _CPU
) -> float:
    r"""Median seconds per call of ``fn`` over ``repeats`` samples, after ``warmup`` calls.

    Each sample runs the call :math:`n` times, :math:`n \in [1, 200]` chosen from one probe
    call so that a sample lasts about 5 ms, and reports the mean over its :math:`n` calls.

    Raises:
        ValueError: if ``repeats < 1`` or ``warmup < 0``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"need repeats >= 1 and warmup >= 0, got {repeats}, {warmup}")
    for _ in range(warmup):
        fn()
    start = clock(device)
    fn()
    inner = max(1, min(200, int(5e-3 / max(clock(device) - start, 1e-6))))
    samples = []
    for _ in range(repeats):
        start = clock(device)
        for _ in range(inner):
            fn()
        samples.append((clock(device) - start) / inner)
    return statistics.median(samples)


def interleaved(
    cells: Mapping[str, Callable[[], Any]],
    rounds: int,
    device: torch.device = _CPU,
    around: Mapping[str, Callable[[], Any]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of every cell, one sample per cell per round, cells round-robin.

    Args:
        cells: label -> the call to time.
        rounds: samples per cell.
        device: where the calls run (picks the clock).
        around: label -> a context-manager factory entered around that cell's samples (e.g. a
            flush-to-zero switch), for cells that differ by a process setting.

    Returns:
        label -> its ``rounds`` samples, in round order (``samples[a][i]`` and
        ``samples[b][i]`` were measured back to back).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    around = around or {}
    samples: dict[str, list[float]] = {label: [] for label in cells}
    for fn in cells.values():
        fn()  # warm-up
    for _ in range(rounds):
        for label, fn in cells.items():
            if label in around:
                with around[label]():
                    samples[label].append(time_call(fn, 1, warmup=0, device=device))
            else:
                samples[label].append(time_call(fn, 1, warmup=0, device=device))
    return samples


def ratio(samples: Mapping[str, Sequence[float]], num: str, den: str) -> float:
    """Median over rounds of the per-round ratio ``num / den`` (load cancels within a round)."""
    return statistics.median(a / b for a, b in zip(samples[num], samples[den], strict=True))


_HOST_READS = frozenset({"_local_scalar_dense", "nonzero", "masked_select"})


def count_dispatch(fn: Callable[[], Any], cuda_kernels: bool = False) -> dict[str, int]:
    """What one call of ``fn`` (after one warm-up call, backward included) dispatches.

    * ``aten ops``: every aten op (a ``TorchDispatchMode``), views included; at small sizes a
      step costs a few microseconds per op whatever the op does, so the count explains times;
    * ``non-view ops``: those that are not views (on a GPU, one or more kernel launches each
      in eager mode);
    * ``host reads``: ops whose result the host waits for (``item``/``nonzero``): one device
      synchronisation each on a GPU;
    * ``cuda kernels`` (if ``cuda_kernels``): the CUDA kernels ``torch.profiler`` records,
      which also counts fused (compiled) kernels.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"aten ops": 0, "non-view ops": 0, "host reads": 0}

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # torch's hook signature
            counts["aten ops"] += 1
            counts["non-view ops"] += not func.is_view
            counts["host reads"] += func._schema.name.split("::")[-1] in _HOST_READS
            return func(*args, **(kwargs or {}))

    fn()
    with Counter():
        fn()
    if cuda_kernels:
        counts["cuda kernels"] = count_cuda_kernels(fn)
    return counts


def count_ops(fn: Callable[[], Any]) -> int:
    """Aten ops dispatched by one call of ``fn`` (:func:`count_dispatch`)."""
    return count_dispatch(fn)["aten ops"]


def count_cuda_kernels(fn: Callable[[], Any]) -> int:
    """CUDA kernels ``torch.profiler`` records during one call of ``fn`` (-1 without CUDA)."""
    from torch.profiler import ProfilerActivity, profile

    if not torch.cuda.is_available():
        return -1
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    return sum(1 for e in prof.events() if e.device_type == cuda)


def count_subnormals(fn: Callable[[], Any]) -> int:
    """Subnormal floats in the outputs of every aten op of one call (after one warm-up call).

    Subnormal arithmetic stalls x86 CPUs (about 30x per op), so a formula that produces them
    in its tails is slow exactly where trained networks sit.
    """
    from torch.utils._python_dispatch import TorchDispatchMode

    total = 0

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]  # torch's hook signature
            nonlocal total
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, Tensor) and t.is_floating_point():
                    total += int(((t != 0) & (t.abs() < torch.finfo(t.dtype).tiny)).sum())
            return out

    fn()
    with Counter():
        fn()
    return total


def peak_memory_mib(fn: Callable[[], Any], device: torch.device = _CPU) -> float:
    """Peak memory one call of ``fn`` adds, in MiB (tensors alive before it are not counted).

    On a CPU: replays, in time order, the bytes each profiled op allocated net of what it freed
    (``self_cpu_memory_usage`` with ``profile_memory=True``; tracemalloc does not see torch's
    allocator). On CUDA: ``torch.cuda.max_memory_allocated`` during the call minus what was
    allocated before.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    held = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        held += event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak / 2**20


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine(device: torch.device = _CPU) -> dict[str, Any]:
    """Where a number was measured: CPU model, load average, threads, torch, GPU if any."""
    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def markdown_table(
    rows: Sequence[Mapping[str, Any]], cols: Sequence[str], fmt: str = "{:.3f}"
) -> str:
    """A Markdown table of ``rows`` over ``cols``; floats formatted with ``fmt``, missing as ``-``."""

    def cell(v: Any) -> str:
        if v is None:
            return "-"
        return fmt.format(v) if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
