"""Smoke test of recipes/speed_benchmark.py: every building block runs at toy sizes.

No timing assertions (timings on shared CI machines mean nothing); only that each step, layer
and report function runs and returns well-formed numbers.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "speed_benchmark.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("speed_benchmark", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["speed_benchmark"] = module
    spec.loader.exec_module(module)
    return module


def test_every_training_step_runs_and_reports(bench):
    rows = bench.bench_steps([4], [3], repeats=1)
    (row,) = rows
    for name, _, _ in bench.STEP_METHODS:
        assert math.isfinite(row[name]) and row[name] > 0, name
    ratios = bench.step_ratios(rows)
    assert set(ratios[0]) >= {"dDVI / plain", "DVI / MCVI S=10", "Pyro / dDVI"}
    assert "| plain MLP |" in bench.table(rows, ["plain MLP", "dDVI"])


def test_layer_scaling_memory_and_crossover(bench):
    rows = bench.bench_layer([4, 8], repeats=1, quick=True)
    assert [r["d"] for r in rows] == [4, 8]
    assert all(r["DVI peak MiB"] > 0 for r in rows)
    synthetic = [{"d": 16, "DVI": 1.0, "M": 4.0}, {"d": 64, "DVI": 16.0, "M": 4.0}]
    assert bench.crossovers(synthetic, "M") == [pytest.approx(32.0)]
    assert bench.describe_crossover(synthetic, "M") == "DVI cheaper for d in [16, 32)"
    assert bench.describe_crossover(synthetic[:1], "M") == "DVI cheaper at every d"
    dearer = [{"d": 16, "DVI": 8.0, "M": 4.0}, {"d": 64, "DVI": 1.0, "M": 4.0}]
    assert bench.describe_crossover(dearer, "M") == "DVI cheaper for d in (25, 64]"


def test_peak_memory_counts_what_the_call_adds(bench):
    def f():
        a = torch.empty(1 << 18)  # 1 MiB, freed before the second one exists
        del a
        return torch.empty(1 << 19)  # 2 MiB

    assert bench.peak_memory_mib(f) == pytest.approx(2.0, rel=0.05)


def test_pyro_guide_step_against_bare(bench):
    row = bench.bench_pyro_guide(4, 3, repeats=1)
    assert row["bare dDVI"] > 0 and (row.get("DeterministicGuide", 1.0) > 0 or "missing" in row)


def test_cli_quick_json(bench, tmp_path):
    threads_before = torch.get_num_threads()
    out = tmp_path / "speed.json"
    argv = ["--quick", "--sections", "layer", "--repeats", "1", "--malloc", "reuse"]
    result = bench.main([*argv, "--json", str(out)])
    saved = json.loads(out.read_text())
    assert saved["threads"] == 1 and saved["layer"] == result["layer"]
    assert saved["malloc"] == "reuse"  # the allocator a fit sets, recorded with the figures
    assert set(saved["crossover"]) == {"MCVI S=1", "MCVI S=10"}
    assert torch.get_num_threads() == threads_before


def test_net_section_quick_json_and_no_default_data_dir(bench, tmp_path):
    out = tmp_path / "net.json"
    argv = ["--quick", "--sections", "net,frontends", "--widths", "6", "--batch", "4"]
    result = bench.main([*argv, "--repeats", "1", "--compiled", "off", "--json", str(out)])
    (row,) = json.loads(out.read_text())["net"]
    assert row == result["net"][0] and row["d"] == 6 and result["device"] == "cpu"
    for name, _, _ in bench.NET_METHODS:
        assert math.isfinite(row[name]) and row[name] > 0, name
        assert row[name + " peak MiB"] >= 0
    assert "lightning" not in result  # no machine-specific default for --data-dir


def test_net_compiled_cells(bench):
    (row,) = bench.bench_net([5], 1, {"backend": "eager", "fullgraph": True}, 3, methods=["DVI"])
    assert row["DVI compiled"] > 0 and row["DVI compiled compile s"] > 0


def test_count_ops_of_the_net_section(bench):
    (row,) = bench.bench_net([4], 1, None, 3, methods=["plain MLP", "dDVI"], count=True)
    ops = row["dDVI ops"]
    assert set(ops) == {"aten ops", "non-view ops", "host reads"}  # no CUDA kernels on a CPU
    assert ops["aten ops"] > ops["non-view ops"] > row["plain MLP ops"]["non-view ops"] > 0
    assert ops["host reads"] == 1  # the input's NaN/Inf check, once per step
    assert bench.op_rows([row])[0]["dDVI"].count(" / ") == 2
    assert bench.count_ops(bench.net_step("plain MLP", 4, 3)) == row["plain MLP ops"]["aten ops"]


def test_anatomy_splits_each_step_and_sees_the_compiled_kernels(bench):
    methods = (*bench.ANATOMY_METHODS, "dDVI compiled step")
    rows = bench.bench_anatomy(1, [(4, 3)], methods, calls=3, top=3)
    assert [r["method"] for r in rows] == list(methods)
    for r in rows:
        parts = [r[k] for k in ("aten ms", "fused ms", "Function ms", "rest ms")]
        assert all(p >= 0 for p in parts) and r["step ms"] > 0, r
        # the measured parts share out the profiled step (the rest is what they leave), and
        # every step dispatches aten ops (a compiled one its matrix products)
        assert sum(parts[:3]) <= r["profiled ms"] * 1.05 and parts[0] > 0, r
        assert len(r["top"]) == 3 and all(ms > 0 for _, ms in r["top"])
    plain, eager, compiled = rows
    # an eager step has no generated kernels; the compiled one reports its own to the profiler
    assert plain["fused ms"] == eager["fused ms"] == 0 < compiled["fused ms"]
    assert eager["Function ms"] > 0  # the library's autograd Functions run in the eager step
    report = bench.report_anatomy(rows)
    assert "| dDVI compiled step |" in report and "top events" in report
