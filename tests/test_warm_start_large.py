"""Issue 44, item 5: the warm start on large tables reports progress and can be turned off.

A 400,000-row CSV spent 8 silent minutes in the full-batch ``PointEstimateWarmStart``, even with
the mini-batch Adam flags the CSV recipe recommends for large tables. Here, on tiny data:
progress lines through the run's progress callback (a captured stream, and a real
``lightning-dvi`` process on a CSV on disk), the switch (``mode="none"``, ``--warm_start
none``), ``mode="auto"`` off under mini-batches (the recipe's Adam flags), the ``max_rows``
subsample, and the peak memory reported with the rows.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import lightning
import numpy as np
import pandas as pd
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_dvi import DVIRegressor
from lightning_dvi.callbacks import DVIProgressBar, PointEstimateWarmStart, ProgressLog
from lightning_dvi.cli import cli
from lightning_dvi.lightning import warm_start as warm_start_module
from lightning_dvi.lightning.progress import (
    PhaseProgress,
    describe_data,
    peak_memory,
    phase_progress,
)

REPO = Path(__file__).resolve().parents[1]
CSV_RECIPE = REPO / "recipes" / "csv_regression.yaml"


def _data(n: int = 200, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g) * 4 - 2
    y = torch.sin(2 * x[:, 0]) + 0.5 * x[:, 1] + 0.05 * torch.randn(n, generator=g)
    return x, y


def _trainer(*callbacks: lightning.Callback, progress: bool = False) -> lightning.Trainer:
    return lightning.Trainer(
        max_steps=1,
        callbacks=list(callbacks),
        logger=False,
        enable_progress_bar=progress,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _csv(path: Path, rows: int = 300) -> Path:
    """A small regression table on disk: 4 inputs, a linear and a nonlinear part, noise."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 4)).astype(np.float32)
    y = x @ np.array([1.0, -0.5, 0.3, 0.0]) + np.sin(2 * x[:, 0]) * x[:, 1]
    table = pd.DataFrame(x, columns=[f"x{i}" for i in range(4)])
    table["target"] = y + 0.1 * rng.standard_normal(rows)
    table.to_csv(path, index=False)
    return path


@pytest.fixture
def fit_calls(monkeypatch) -> list[int]:
    """The training rows of every ``fit_point_estimate`` call the callback makes."""
    calls: list[int] = []
    original = warm_start_module.fit_point_estimate

    def spy(net, likelihood, x, *args, **kwargs):
        calls.append(int(x.shape[0]))
        return original(net, likelihood, x, *args, **kwargs)

    monkeypatch.setattr(warm_start_module, "fit_point_estimate", spy)
    return calls


def test_the_warm_start_writes_progress_lines_through_the_progress_log():
    lightning.seed_everything(0, verbose=False)
    x, y = _data(240)
    train = DataLoader(TensorDataset(x[:200], y[:200]), batch_size=200)
    val = DataLoader(TensorDataset(x[200:], y[200:]), batch_size=40)
    stream = io.StringIO()
    warm = PointEstimateWarmStart(max_steps=4, patience=10, iterations=3)
    log = ProgressLog(every_n_seconds=1e-9, stream=stream)
    _trainer(warm, log, progress=True).fit(DVIRegressor(in_features=2, hidden=[8]), train, val)
    lines = stream.getvalue().splitlines()
    warm_lines = [line for line in lines if line.startswith("warm start: ")]
    # announced before any step, with the rows, the inputs and the peak memory
    assert warm_lines[0].startswith(
        "warm start: fitting the means as a plain network on 200 training rows x 2 inputs, "
        "40 held out (full batch, L-BFGS, at most 4 steps of 3 iterations); peak memory "
    )
    # the start and one line per step (the interval is tiny): step, losses, elapsed time
    steps = warm_lines[1:-1]
    assert [line.split()[3] for line in steps] == ["0/4", "1/4", "2/4", "3/4", "4/4"]
    for line in steps:
        assert " loss " in line and " held-out loss " in line and line.endswith(" s")
    assert warm_lines[-1].startswith(
        "warm start: done, 4 L-BFGS steps on 200 training rows (max_steps)"
    )
    assert "peak memory" in warm_lines[-1]
    # all of it before training's own first line
    assert lines.index(warm_lines[-1]) < lines.index(
        next(line for line in lines if line.startswith("fit: training"))
    )
    # the losses printed are the fit's: the last held-out loss is the kept step's
    assert warm.result is not None and warm.result.val_loss is not None
    best = min(float(line.split("held-out loss ")[1].split()[0]) for line in steps)
    assert best == pytest.approx(warm.result.val_loss, rel=1e-3)


def test_without_a_progress_callback_nothing_is_printed_and_the_fit_is_the_same(capsys):
    """The progress hook only reads losses: the same means with and without the lines."""
    x, y = _data(200)
    means = []
    for progress in (False, True):
        lightning.seed_everything(0, verbose=False)
        loader = DataLoader(TensorDataset(x, y), batch_size=200)
        model = DVIRegressor(in_features=2, hidden=[8])
        log = [ProgressLog(every_n_seconds=1e-9)] if progress else []
        _trainer(PointEstimateWarmStart(max_steps=3), *log, progress=progress).fit(model, loader)
        means.append(model.net[0].weight_loc.detach().clone())
        err = capsys.readouterr().err
        assert ("warm start: step 1/3" in err) == progress
    torch.testing.assert_close(means[0], means[1], rtol=0, atol=0)


def test_mode_none_turns_the_warm_start_off(fit_calls):
    x, y = _data(200)
    loader = DataLoader(TensorDataset(x, y), batch_size=200)
    for mode, called in (("none", False), ("point", True), ("auto", True)):
        fit_calls.clear()
        lightning.seed_everything(0, verbose=False)
        warm = PointEstimateWarmStart(max_steps=2, mode=mode)
        _trainer(warm).fit(DVIRegressor(in_features=2, hidden=[8]), loader)
        assert bool(fit_calls) == called, mode
        assert (warm.result is not None) == called and (warm.skipped is None) == called, mode


def test_auto_is_off_under_mini_batches_and_point_fits_anyway(fit_calls):
    x, y = _data(200)
    loader = DataLoader(TensorDataset(x, y), batch_size=50)  # 4 mini-batches per epoch
    warm = PointEstimateWarmStart(max_steps=2)  # mode="auto", the default
    _trainer(warm).fit(DVIRegressor(in_features=2, hidden=[8]), loader)
    assert fit_calls == [] and warm.result is None
    assert warm.skipped is not None and "mini-batches (4 per epoch)" in warm.skipped
    warm = PointEstimateWarmStart(max_steps=2, mode="point")
    _trainer(warm).fit(DVIRegressor(in_features=2, hidden=[8]), loader)
    assert fit_calls == [180] and warm.result is not None  # every batch, less the holdout


def test_max_rows_fits_a_seeded_subsample(fit_calls):
    x, y = _data(200)
    loader = DataLoader(TensorDataset(x, y), batch_size=200)
    stream = io.StringIO()
    warm = PointEstimateWarmStart(max_steps=2, max_rows=60)
    log = ProgressLog(every_n_seconds=10.0, stream=stream)
    _trainer(warm, log, progress=True).fit(DVIRegressor(in_features=2, hidden=[8]), loader)
    assert fit_calls == [60]
    assert "on 60 of 180 training rows x 2 inputs, 20 held out" in stream.getvalue()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"mode": "off"}, "mode must be 'auto' or 'point' or 'none'"), ({"max_rows": 0}, "max_rows")],
)
def test_bad_settings_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        PointEstimateWarmStart(**kwargs)


def test_phase_progress_lines_and_peak_memory():
    stream = io.StringIO()
    phase = PhaseProgress("warm start", 10, every_n_seconds=3600.0, stream=stream)
    phase.start("go")
    phase.step(1, {"loss": 0.5, "held-out loss": None})  # inside the interval: no line
    phase.step(2, {"loss": 0.25, "held-out loss": None}, force=True)
    lines = stream.getvalue().splitlines()
    assert lines[0] == "warm start: go"
    assert lines[1].startswith("warm start: step 2/10  loss 0.25  ") and len(lines) == 2
    peak = peak_memory()
    assert peak is not None and peak > 10_000_000  # bytes: a Python process with torch
    assert describe_data(object()) is None


def test_phase_progress_follows_the_runs_progress_callback(capsys):
    """A terminal bar: lines on standard error, at most one a second; no bar: nothing."""
    quiet = {"logger": False, "enable_checkpointing": False, "enable_model_summary": False}
    terminal = lightning.Trainer(callbacks=[DVIProgressBar()], **quiet)
    phase = phase_progress(terminal, "warm start", 5)
    assert phase.enabled and phase.every_n_seconds == 1.0
    capsys.readouterr()
    phase.write("hello")
    assert capsys.readouterr().err.splitlines() == ["warm start: hello"]
    silent = phase_progress(lightning.Trainer(enable_progress_bar=False, **quiet), "w", 5)
    capsys.readouterr()
    silent.write("hello")
    assert not silent.enabled and "hello" not in capsys.readouterr().err


def test_the_cli_switch_and_the_adam_flags_turn_the_warm_start_off(cli_workdir, capsys):
    """``--warm_start none`` on the recipe as written; the recipe's Adam flags alone."""
    path = _csv(cli_workdir / "table.csv")
    base = ["fit", "--config", str(CSV_RECIPE), "--data.path", str(path)]
    runs = {
        "switch": [*base, "--warm_start", "none", "--trainer.max_epochs", "1"],
        "adam flags": [*base, "--model.optimizer", "adam", "--data.batch_size", "64"],
    }
    for name, args in runs.items():
        run = cli([*args, "--trainer.max_epochs", "1", "--test_after_fit", "false"])
        (warm,) = [c for c in run.trainer.callbacks if isinstance(c, PointEstimateWarmStart)]
        assert warm.result is None and warm.skipped is not None, name
        err = capsys.readouterr().err
        assert "warm start: off" in err and "warm start: step" not in err, name
    assert "mini-batches (4 per epoch)" in err  # 210 training rows in batches of 64


def test_a_real_cli_run_prints_warm_start_progress_and_peak_memory_with_the_rows(tmp_path):
    """The user's run: ``lightning-dvi fit`` on a CSV on disk, output piped."""
    path = _csv(tmp_path / "table.csv")
    script = Path(sys.executable).with_name("lightning-dvi")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "lightning_dvi.cli"]
    args = ["fit", "--config", str(CSV_RECIPE), "--data.path", str(path)]
    args += ["--trainer.max_epochs", "2", "--test_after_fit", "false"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(
        [*command, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    err = done.stderr.splitlines()
    first = next(i for i, line in enumerate(err) if line.startswith("warm start: "))
    assert err[first].startswith("warm start: fitting the means as a plain network on 210 ")
    assert err[first + 1].startswith("warm start: step 0/200  loss ")
    assert any(line.startswith("warm start: done, ") for line in err)
    # the summary: rows x inputs and the process's peak memory
    (data,) = [line for line in done.stdout.splitlines() if line.startswith("data:")]
    assert "210 training rows (30 validation, 60 test) x 4 inputs; peak memory " in data
    assert data.endswith(" MB") or data.endswith(" GB")
