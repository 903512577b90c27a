"""How long reading a numeric CSV takes: lightning_dvi's reader against ``pandas.read_csv``.

Writes a ``rows x cols`` table of random float64 numbers (shortest round-trip text, ~19 digits
per cell, header ``c0,c1,...``), then times, interleaved so that machine load hits each alike:

* ``pandas.read_csv(path)`` (C engine, pandas' defaults);
* ``lightning_dvi.data.read_tabular(path)``: the strict pyarrow reader, float64 ``[rows, cols]``;
* ``CSVDataModule(path, target="c<last>").num_train``: the whole data module build (read,
  split, float64 standardisation, float32 overflow check, tensors).

Each is run ``--repeats`` times after one warm-up; the table gives the median wall time and the
median CPU time of this process (``time.process_time``, all threads: pyarrow parses with
several), and the ratio of each median wall time to pandas'. The acceptance of issue 25 is
reading at most 2x ``pandas.read_csv``'s time. ``--check`` also compares the values read with
``numpy.loadtxt``'s (they must be equal bit for bit).

Usage::

    .venv/bin/python recipes/read_benchmark.py                      # 300k x 9, 7 repeats
    .venv/bin/python recipes/read_benchmark.py --rows 1000 --repeats 1 --check
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from lightning_dvi.data import CSVDataModule, read_tabular


def write_table(path: Path, rows: int, cols: int, seed: int = 0) -> Path:
    """A CSV of ``rows x cols`` random numbers on mixed scales, written with ``repr`` digits."""
    rng = np.random.default_rng(seed)
    scales = 10.0 ** rng.integers(-3, 6, size=cols)
    table = rng.normal(size=(rows, cols)) * scales
    pd.DataFrame(table, columns=[f"c{j}" for j in range(cols)]).to_csv(
        path, index=False, float_format="%.17g"
    )
    return path


def readers(path: Path, cols: int) -> dict[str, Callable[[], Any]]:
    """The three timed calls on ``path``."""
    return {
        "pandas.read_csv": lambda: pd.read_csv(path),
        "read_tabular": lambda: read_tabular(path),
        "CSVDataModule build": lambda: CSVDataModule(str(path), target=f"c{cols - 1}").num_train,
    }


def bench(path: Path, cols: int, repeats: int) -> list[dict[str, Any]]:
    """Median wall and CPU seconds per reader over ``repeats`` interleaved runs."""
    calls = readers(path, cols)
    wall: dict[str, list[float]] = {name: [] for name in calls}
    cpu: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm-up: imports, page cache
        call()
    for _ in range(repeats):
        for name, call in calls.items():
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            call()
            wall[name].append(time.perf_counter() - start_wall)
            cpu[name].append(time.process_time() - start_cpu)
    base = statistics.median(wall["pandas.read_csv"])
    return [
        {
            "reader": name,
            "wall_s": statistics.median(wall[name]),
            "cpu_s": statistics.median(cpu[name]),
            "wall / pandas": statistics.median(wall[name]) / base,
        }
        for name in calls
    ]


def check(path: Path) -> None:
    """The values read equal numpy's (correctly rounded) parse bit for bit, and pandas' names."""
    names, values, _ = read_tabular(path)
    assert names == list(pd.read_csv(path, nrows=1).columns)
    np.testing.assert_array_equal(values, np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2))


def table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`bench`'s rows."""
    lines = ["| reader | wall s (median) | CPU s (median) | wall / pandas |", "|---|---|---|---|"]
    lines += [
        f"| {r['reader']} | {r['wall_s']:.3f} | {r['cpu_s']:.3f} | {r['wall / pandas']:.2f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--cols", type=int, default=9)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument(
        "--check", action="store_true", help="compare the values with numpy.loadtxt's"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        path = write_table(Path(folder) / "table.csv", args.rows, args.cols)
        size = path.stat().st_size / 2**20
        print(f"{args.rows} rows x {args.cols} columns, {size:.1f} MiB")
        if args.check:
            check(path)
            print("values equal numpy.loadtxt's bit for bit")
        rows = bench(path, args.cols, args.repeats)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
