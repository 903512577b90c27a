"""The speed benchmark's ``anatomy`` section: where one training step's CPU time goes.

For the ``cost`` section's steps (plain MLP, eager dDVI, and with ``--compiled on`` the dDVI step
compiled as one graph) at issue 39's rows: the step's CPU time without the profiler
(``step ms``, median of ``--repeats`` samples), and its CPU time under :mod:`torch.profiler`
(``profiled ms``) split by each event's self CPU time, averaged over the profiled calls, into

* ``aten ms``: the aten ops the step dispatches (kernels, dispatch and allocation; inside a
  compiled step only the ops the generated code calls, such as matrix products and ``erfc``);
* ``fused ms``: a compiled step's own generated kernels (``graph_*_cpp_fused_*``, visible
  because the section compiles with inductor's ``cpp.enable_kernel_profile``);
* ``Function ms``: the Python of the library's autograd Functions and autograd's engine
  events, as far as the profiler sees them;
* ``rest ms``: the profiled step's CPU time (``profiled ms``) less those three: Python
  outside the Functions (modules, checks, caches), the generated wrapper of a compiled step.

The profiler adds about a microsecond per event (``profiled ms`` against ``step ms``), so the
parts of a step of many small ops are shares of the profiled time, not of the step's. The
section also names each step's most expensive events (``top``). Results:
docs/speed_current.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import timing as T
from .speed import make_step
from .speed_cost import COST_ROWS

__all__ = ["ANATOMY_METHODS", "bench_anatomy", "profile_step", "report_anatomy"]

ANATOMY_METHODS: tuple[str, ...] = ("plain MLP", "dDVI")
"""Eager steps of the section; ``--compiled on`` adds ``"dDVI compiled step"``."""

_AUTOGRAD_PREFIXES = ("autograd::", "torch::autograd::")


def _part(name: str) -> str:
    """The part of a step a profiler event belongs to (see the module docstring)."""
    if "cpp_fused" in name:
        return "fused"
    if name.startswith("aten::") or name.startswith("lightning_dvi::"):
        return "aten"
    if name.startswith("## Call CompiledFxGraph") or name.startswith("AOTDispatcher"):
        return "rest"  # the generated wrapper's own Python, reported with the rest
    if name.startswith(_AUTOGRAD_PREFIXES) or name[:1].isupper() or name.startswith("_"):
        return "Function"  # autograd nodes (e.g. _ReluDiag, _ReluDiagBackward) and the engine
    return "rest"


def profile_step(step: Callable[[], Any], calls: int = 50) -> tuple[float, dict[str, float]]:
    """CPU ms per profiled call of ``step``, and the self CPU ms per call of each event."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(5):
        step()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = T.clock()
        for _ in range(calls):
            step()
        total = T.clock() - start
    events = {
        e.key: e.self_cpu_time_total / 1e3 / calls
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    }
    return 1e3 * total / calls, events


def bench_anatomy(
    repeats: int,
    rows: Sequence[tuple[int, int]] | None = None,
    methods: Sequence[str] = ANATOMY_METHODS,
    calls: int = 50,
    top: int = 5,
) -> list[dict[str, Any]]:
    """Per row and method: step ms, profiled ms and its aten / fused / Function / rest parts.

    Args:
        repeats: timed samples of the step (the median is the step's time).
        rows: ``(width, batch)`` pairs (default: the cost section's).
        methods: steps of :func:`~lightning_dvi_benchmarks.speed.make_step`.
        calls: profiled calls per step.
        top: how many of the most expensive events to name.
    """
    out = []
    for width, batch in COST_ROWS if rows is None else rows:
        for method in methods:
            # a compiled step's generated kernels report themselves to the profiler only if
            # compiled so (part of inductor's cache key: a cold compile per row)
            with torch._inductor.config.patch({"cpp.enable_kernel_profile": True}):
                step = make_step(method, width, batch)
            step_ms = 1e3 * T.time_call(step, repeats)
            profiled_ms, events = profile_step(step, calls)
            parts = dict.fromkeys(("aten", "fused", "Function", "rest"), 0.0)
            for name, ms in events.items():
                parts[_part(name)] += ms
            measured = parts["aten"] + parts["fused"] + parts["Function"]
            ranked = sorted(events.items(), key=lambda kv: -kv[1])[:top]
            out.append({
                "width": width, "batch": batch, "method": method, "step ms": step_ms,
                "profiled ms": profiled_ms, "aten ms": parts["aten"], "fused ms": parts["fused"],
                "Function ms": parts["Function"], "rest ms": max(profiled_ms - measured, 0.0),
                "top": ranked,
            })  # fmt: skip
    return out


def _short(name: str, width: int = 48) -> str:
    return name if len(name) <= width else name[: width - 3] + "..."


def report_anatomy(rows: list[dict[str, Any]]) -> str:
    """The section's Markdown report: the parts of each step, then its top events."""
    cols = ["width", "batch", "method", "step ms", "profiled ms", "aten ms", "fused ms",
            "Function ms", "rest ms"]  # fmt: skip
    top = [
        {
            "width": r["width"], "batch": r["batch"], "method": r["method"],
            "top events (self CPU ms per step)": "; ".join(
                f"{_short(name)} {ms:.3f}" for name, ms in r["top"]
            ),
        }
        for r in rows
    ]  # fmt: skip
    return "\n".join([
        "\n## Where a step's CPU time goes (torch.profiler self CPU, ms per step)\n",
        T.markdown_table(rows, cols, "{:.3f}"),
        "\n## The most expensive events of each step\n",
        T.markdown_table(top, ["width", "batch", "method", "top events (self CPU ms per step)"]),
    ])  # fmt: skip
