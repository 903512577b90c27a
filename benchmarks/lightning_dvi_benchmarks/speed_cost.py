"""The speed benchmark's ``cost`` section: issue 39's step-cost table (recipes/speed_benchmark.py).

One training step (``zero_grad`` + forward + loss + ``backward``) of the ``steps`` section's
``8 -> width -> 2`` net for the plain MLP, dDVI, DVI and MCVI with S = 10, at the issue's four
(width, batch) rows, measured as interleaved cells (:func:`~.timing.interleaved`: round-robin in
one process, so machine load hits every cell alike; a ratio is the median of per-round ratios).

Each row also splits a step's time into a fixed part and arithmetic: the op sequence of a step
does not depend on the sizes (the aten op count is the same at every row), so the same step at
width 2 and batch 2, where the arithmetic is negligible, measures what the step costs in
dispatch, autograd bookkeeping and Python; the rest of the step at the row's size is arithmetic
(and memory traffic). (Width or batch 1 would not do: size-1 dimensions change a few ops.)
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from . import timing as T
from .speed import make_step

__all__ = [
    "COMPILED_COST_METHODS",
    "COST_METHODS",
    "COST_ROWS",
    "FIXED_SIZE",
    "bench_cost",
    "report_cost",
]

COST_ROWS: tuple[tuple[int, int], ...] = ((50, 32), (50, 512), (128, 32), (128, 512))
"""``(width, batch)`` of issue 39's table."""

COST_METHODS: tuple[str, ...] = ("plain MLP", "dDVI", "DVI", "MCVI S=10")

COMPILED_COST_METHODS: tuple[str, ...] = ("dDVI compiled step", "DVI compiled step")
"""Added by the recipe's ``--compiled on``: the steps of ``compile=True`` (each cell compiles, or
loads inductor's cache, once before the rounds)."""

FIXED_SIZE = (2, 2)
"""``(width, batch)`` of the step that measures the fixed cost."""


def bench_cost(
    rounds: int,
    rows: Sequence[tuple[int, int]] | None = None,
    methods: Sequence[str] = COST_METHODS,
) -> list[dict[str, Any]]:
    """Median ms per step, the issue's ratios, aten ops and the fixed/arithmetic split per row.

    Args:
        rounds: interleaved samples per cell.
        rows: ``(width, batch)`` pairs (default :data:`COST_ROWS`).
        methods: rows of :data:`lightning_dvi_benchmarks.speed.STEP_METHODS` (the ratios need
            ``"plain MLP"``, ``"dDVI"``, ``"DVI"`` and ``"MCVI S=10"``).
    """
    out = []
    for width, batch in COST_ROWS if rows is None else rows:
        cells: dict[str, Callable[[], None]] = {}
        for method in methods:
            cells[method] = make_step(method, width, batch)
            cells[f"{method} @2x2"] = make_step(method, *FIXED_SIZE)
        samples = T.interleaved(cells, rounds)
        row: dict[str, Any] = {"width": width, "batch": batch}
        for method in methods:
            step_ms = 1e3 * statistics.median(samples[method])
            fixed_ms = 1e3 * statistics.median(samples[f"{method} @2x2"])
            # a compiled step runs one graph of inductor's kernels, which are not aten ops
            # (and a step compiled through torch.compile refuses the counting dispatch mode)
            counts = (
                {"aten ops": None, "non-view ops": None}
                if method in COMPILED_COST_METHODS
                else T.count_dispatch(cells[method])
            )
            row[method] = step_ms
            row[f"{method} fixed ms"] = fixed_ms
            row[f"{method} arithmetic ms"] = max(step_ms - fixed_ms, 0.0)
            row[f"{method} ops"] = counts["aten ops"]
            row[f"{method} non-view ops"] = counts["non-view ops"]
        if {"plain MLP", "dDVI"} <= set(methods):
            row["dDVI / plain"] = T.ratio(samples, "dDVI", "plain MLP")
        if {"DVI", "MCVI S=10"} <= set(methods):
            row["DVI / MCVI S=10"] = T.ratio(samples, "DVI", "MCVI S=10")
        if {"plain MLP", "dDVI compiled step"} <= set(methods):
            row["dDVI compiled / plain"] = T.ratio(samples, "dDVI compiled step", "plain MLP")
        out.append(row)
    return out


def report_cost(rows: list[dict[str, Any]]) -> str:
    """The section's Markdown report: times and ratios, then ops and the time split."""
    methods = [m for m in (*COST_METHODS, *COMPILED_COST_METHODS) if m in rows[0]]
    ratios = [
        k for k in ("dDVI / plain", "DVI / MCVI S=10", "dDVI compiled / plain") if k in rows[0]
    ]
    times = [{"width": r["width"], "batch": r["batch"], **{m: r[m] for m in methods},
              **{k: r[k] for k in ratios}} for r in rows]  # fmt: skip
    split = []
    for r in rows:
        cell: dict[str, Any] = {"width": r["width"], "batch": r["batch"]}
        for m in methods:
            ops = "—" if r[f"{m} ops"] is None else f"{r[f'{m} ops']} / {r[f'{m} non-view ops']}"
            cell[m] = f"{ops}; {r[f'{m} fixed ms']:.3f} + {r[f'{m} arithmetic ms']:.3f}"
        split.append(cell)
    return "\n".join([
        "\n## Step cost (issue 39): ms per step, median of interleaved rounds, 1 thread\n",
        T.markdown_table(times, ["width", "batch", *methods, *ratios], "{:.3f}"),
        "\n## Aten ops / non-view ops per step; fixed ms (the step at width 2, batch 2) "
        "+ arithmetic ms\n",
        T.markdown_table(split, ["width", "batch", *methods]),
    ])  # fmt: skip
