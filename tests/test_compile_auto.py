"""``compile="auto"`` (issue 39, item 2): the decision rule, its inputs, and a fit that takes it.

The step times are a fake clock (results, never timings): each reading of
``time.perf_counter`` inside :mod:`lightning_dvi.lightning.compile_auto` advances it by the
step time the test chooses. The compile itself uses ``backend="eager"`` (the decision and the
switch are what is tested; inductor's cache is measured by ``recipes/compile_cache.py``).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from helpers import cpu_trainer
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIRegressor
from lightning_dvi.lightning import compile_auto
from lightning_dvi.lightning.compile_auto import (
    DEFAULT_COMPILE_SECONDS,
    AutoCompile,
    CompileAuto,
    compile_pays,
    compile_setting,
    compile_times_path,
)


def test_compile_pays_when_the_saved_time_exceeds_the_compile():
    # saved = R t (1 - 1/k): 1000 x 0.03 x 2/3 = 20 s at k = 3; 1000 x 0.03 x 4/9 = 13.3 s at the default
    assert compile_pays(1000, 0.03, 19.9, speedup=3.0)
    assert not compile_pays(1000, 0.03, 20.1, speedup=3.0)
    assert compile_pays(1000, 0.03, 9.9) and not compile_pays(1000, 0.03, 10.1)  # k = 1.5
    assert compile_pays(math.inf, 1e-6, 1e6)  # an open-ended run always pays
    assert not compile_pays(0, 1.0, 0.0)
    with pytest.raises(ValueError, match="speedup must be > 1"):
        compile_pays(1, 1.0, 1.0, speedup=1.0)


def test_compile_setting_reads_auto_and_passes_the_rest_on():
    assert compile_setting(False) == (None, None)
    assert compile_setting(True) == ({}, None)
    assert compile_setting("reduce-overhead") == ({"mode": "reduce-overhead"}, None)
    assert compile_setting("auto") == (None, AutoCompile({}))
    assert compile_setting({"auto": True, "backend": "eager"}) == (
        None,
        AutoCompile({"backend": "eager"}),
    )
    assert compile_setting({"auto": False, "backend": "eager"}) == ({"backend": "eager"}, None)
    with pytest.raises(ValueError, match="compile\\['auto'\\] must be a bool"):
        compile_setting({"auto": "yes"})
    with pytest.raises(ValueError, match="compile must be a bool"):
        compile_setting("sometimes")


def test_compile_times_live_next_to_the_inductor_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert compile_times_path() == tmp_path / "lightning_dvi_compile_seconds.json"


class _Clock:
    """``perf_counter`` that advances by ``step`` seconds per reading (so end - start = step)."""

    def __init__(self, step: float) -> None:
        self.step, self.now = step, 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


def _fit(
    monkeypatch, tmp_path, step_seconds: float, max_steps: int
) -> tuple[DVIRegressor, CompileAuto]:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compile_auto.time, "perf_counter", _Clock(step_seconds))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, generator=g)
    y = x.sum(1, keepdim=True) + 0.1 * torch.randn(64, 1, generator=g)
    torch.manual_seed(0)
    model = DVIRegressor(2, [8], mode="diag", compile={"auto": True, "backend": "eager"})
    trainer = cpu_trainer(max_steps=max_steps, default_root_dir=tmp_path)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=16))
    auto = next(c for c in trainer.callbacks if isinstance(c, CompileAuto))
    return model, auto


def test_the_recorded_compile_times_keep_the_two_compiled_paths_apart():
    whole = DVIRegressor(2, [8], mode="diag")
    assert compile_auto._whole_step(whole, {})
    assert not compile_auto._whole_step(whole, {"mode": "reduce-overhead"})  # CUDA graphs
    assert not compile_auto._whole_step(DVIRegressor(2, [8], mode="sample", num_samples=2), {})


def test_a_short_run_stays_eager(monkeypatch, tmp_path):
    model, auto = _fit(monkeypatch, tmp_path, step_seconds=0.01, max_steps=12)
    assert auto.decision is not None and not auto.decision.compiled
    assert auto.decision.remaining_steps == 12 - 4  # decided after the warm-up and 3 timed steps
    assert auto.decision.eager_step_seconds == pytest.approx(0.01)
    assert auto.decision.compile_seconds == DEFAULT_COMPILE_SECONDS
    assert model._compile is None and "_compiled_elbo_fn" not in model.__dict__
    assert not compile_times_path().exists()


def test_a_long_run_compiles_and_records_the_compile_time(monkeypatch, tmp_path):
    # 20 - 4 steps left x 20 s x (1 - 1/1.5) = 107 s saved > the assumed 60 s
    model, auto = _fit(monkeypatch, tmp_path, step_seconds=20.0, max_steps=20)
    assert auto.decision is not None and auto.decision.compiled
    assert not auto.decision.measured_before
    assert model._compile == {"backend": "eager"}
    assert "_compiled_elbo_fn" in model.__dict__  # the later steps ran compiled
    assert auto.compile_seconds == pytest.approx(0.0)  # the fake clock's steps all take 20 s
    recorded = json.loads(compile_times_path().read_text())
    assert list(recorded.values()) == [pytest.approx(0.0)]
    # the next run of the same network reads the measured compile time
    _, again = _fit(monkeypatch, tmp_path, step_seconds=20.0, max_steps=20)
    assert again.decision is not None and again.decision.measured_before
    assert again.decision.compile_seconds == pytest.approx(0.0)


def test_an_auto_compiled_fit_matches_the_eager_fit(monkeypatch, tmp_path):
    compiled, auto = _fit(monkeypatch, tmp_path, step_seconds=100.0, max_steps=8)
    assert auto.decision is not None and auto.decision.compiled
    eager, auto = _fit(monkeypatch, tmp_path / "eager", step_seconds=1e-6, max_steps=8)
    assert auto.decision is not None and not auto.decision.compiled
    for a, b in zip(compiled.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
