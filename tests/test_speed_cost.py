"""The speed benchmark's ``cost`` section (issue 39's step-cost table) at toy sizes.

No timing assertions: only that the cells run, the table is well formed, and the premise of
the fixed/arithmetic split holds (a step's op sequence does not depend on the sizes).
"""

from __future__ import annotations

import math

from lightning_dvi_benchmarks.speed import make_step
from lightning_dvi_benchmarks.speed_cost import COST_METHODS, FIXED_SIZE, bench_cost, report_cost
from lightning_dvi_benchmarks.timing import count_dispatch


def test_cost_rows_report_times_ratios_and_ops():
    rows = bench_cost(rounds=2, rows=[(4, 3)])
    (row,) = rows
    assert (row["width"], row["batch"]) == (4, 3)
    for method in COST_METHODS:
        assert math.isfinite(row[method]) and row[method] > 0, method
        assert row[f"{method} fixed ms"] > 0 and row[f"{method} arithmetic ms"] >= 0
        assert row[f"{method} ops"] >= row[f"{method} non-view ops"] > 0
    assert row["dDVI / plain"] > 0 and row["DVI / MCVI S=10"] > 0
    text = report_cost(rows)
    assert "| width | batch | plain MLP | dDVI | DVI | MCVI S=10 |" in text
    assert f"{row['dDVI ops']} / {row['dDVI non-view ops']};" in text


def test_a_steps_op_count_does_not_depend_on_its_sizes():
    """What the split's small step relies on."""
    for method in COST_METHODS:
        small = count_dispatch(make_step(method, *FIXED_SIZE))
        large = count_dispatch(make_step(method, 50, 32))
        assert small == large, method
