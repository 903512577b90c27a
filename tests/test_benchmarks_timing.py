"""The speed benchmarks' timing harness (lightning_dvi_benchmarks.timing)."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from lightning_dvi_benchmarks import timing as T


def _busy(seconds: float):
    def fn():
        end = time.process_time() + seconds
        while time.process_time() < end:
            pass

    return fn


def test_time_call_measures_cpu_time_of_the_call():
    got = T.time_call(_busy(2e-3), repeats=3, warmup=1)
    assert 1.8e-3 <= got <= 4e-3  # CPU time: other processes' load does not count
    with pytest.raises(ValueError, match="repeats"):
        T.time_call(lambda: None, repeats=0)


def test_time_call_does_not_count_sleep():
    # wall time passes while sleeping, CPU time does not: the harness measures the latter
    assert T.time_call(lambda: time.sleep(2e-3), repeats=3, warmup=0) < 1e-3


def test_interleaved_runs_cells_round_robin_and_ratio_is_the_median_per_round_ratio():
    order = []
    entered = []

    @contextlib.contextmanager
    def switch():
        entered.append(True)
        yield

    cells = {"a": lambda: order.append("a"), "b": lambda: order.append("b")}
    samples = T.interleaved(cells, rounds=3, around={"b": switch})
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3}
    assert len(entered) == 3  # once per sample of "b"
    # one warm-up each, then a, b, a, b, ... (each sample is one call after a probe call)
    assert order[:2] == ["a", "b"] and order[2] == "a" and order[-1] == "b"
    assert T.ratio({"x": [2.0, 4.0, 9.0], "y": [1.0, 1.0, 3.0]}, "x", "y") == 3.0
    with pytest.raises(ValueError, match=r"strict|length|shorter|longer"):
        T.ratio({"x": [1.0], "y": [1.0, 2.0]}, "x", "y")


def test_count_dispatch_counts_aten_ops_views_and_host_reads():
    x = torch.ones(3)
    counts = T.count_dispatch(lambda: (x + 1).sum().item())
    assert counts == {"aten ops": 3, "non-view ops": 3, "host reads": 1}
    assert T.count_dispatch(lambda: x.view(3, 1))["non-view ops"] == 0
    assert T.count_ops(lambda: x * 2) == 1


def test_count_subnormals_sees_subnormal_outputs():
    tiny = torch.finfo(torch.float32).tiny
    x = torch.tensor([tiny, 1.0])
    assert T.count_subnormals(lambda: x * 0.25) == 1  # tiny/4 is subnormal in float32
    assert T.count_subnormals(lambda: x * 2.0) == 0


def test_peak_memory_counts_what_the_call_allocates():
    def alloc():
        t = torch.empty(2**18, dtype=torch.float32)  # 1 MiB
        return t.fill_(1.0).sum()

    assert 0.99 <= T.peak_memory_mib(alloc) <= 1.1


def test_machine_and_table():
    info = T.machine()
    assert info["threads"] >= 1 and info["torch"] == torch.__version__ and info["cpu"]
    table = T.markdown_table([{"a": 1.23456, "b": "x"}, {"a": None}], ["a", "b"])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1.235 | x |", "| - | - |"]
