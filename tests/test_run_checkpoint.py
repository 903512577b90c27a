"""RunCheckpoint: last.ckpt during training, whatever the Lightning version; one directory per run.

Lightning's own ``ModelCheckpoint(save_last=True, save_top_k=0)`` writes ``last.ckpt`` every
epoch on Lightning 2.2 and only at the end of training on 2.6; these tests read the file at the
start of every epoch, so they fail on any version where it is not written during training.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_dvi import DVIRegressor
from lightning_dvi.callbacks import DVIProgressBar, ProgressLog, RunCheckpoint
from lightning_dvi.cli import cli
from lightning_dvi.data import ToyHeteroscedasticDataModule
from lightning_dvi.lightning.checkpoint import find_last_checkpoint

REPO = Path(__file__).resolve().parents[1]
TOY = REPO / "recipes" / "toy_heteroscedastic.yaml"


class SavedSteps(Callback):
    """The global step held by last.ckpt at the start of each epoch (None: no file yet)."""

    def __init__(self) -> None:
        self.steps: list[int | None] = []

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        checkpoint = next(c for c in trainer.checkpoint_callbacks if isinstance(c, RunCheckpoint))
        path = Path(str(checkpoint.dirpath), checkpoint.filename_last)
        saved = torch.load(path, weights_only=True) if path.is_file() else None
        self.steps.append(None if saved is None else saved["global_step"])


def _fit(root: Path, checkpoint: Callback, *, logger: bool = True, epochs: int = 4):
    seed_everything(0)
    spy = SavedSteps()
    trainer = cpu_trainer(
        default_root_dir=root,
        max_epochs=epochs,
        callbacks=[checkpoint, spy],
        logger=CSVLogger(root) if logger else False,
    )
    dm = ToyHeteroscedasticDataModule(num_train=48, num_val=16, num_test=16, batch_size=16)
    trainer.fit(DVIRegressor(hidden=[4], lr=0.01), dm)  # 3 steps per epoch
    return trainer, spy.steps


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, [None, 3, 6, 9]),
        ({"every_n_epochs": 2}, [None, None, 6, 6]),
        ({"every_n_epochs": 0, "every_n_train_steps": 2}, [None, 2, 6, 8]),
    ],
)
def test_last_ckpt_is_written_during_training(tmp_path, kwargs, expected):
    trainer, steps = _fit(tmp_path, RunCheckpoint(**kwargs))
    assert steps == expected
    final = torch.load(trainer.checkpoint_callback.last_model_path, weights_only=True)
    assert final["global_step"] == 12  # and the end of training is always saved
    # in the logger's run directory, beside metrics.csv
    assert Path(trainer.checkpoint_callback.last_model_path) == (
        Path(trainer.log_dir) / "checkpoints" / "last.ckpt"
    )


def test_a_time_interval_writes_after_that_long(tmp_path):
    class Slow(Callback):
        def on_train_batch_start(self, *args) -> None:
            time.sleep(0.02)

    checkpoint = RunCheckpoint(every_n_epochs=0, train_time_interval=0.05)
    seed_everything(0)
    spy = SavedSteps()
    trainer = cpu_trainer(
        default_root_dir=tmp_path, max_epochs=3, callbacks=[checkpoint, Slow(), spy]
    )
    dm = ToyHeteroscedasticDataModule(num_train=48, num_val=16, num_test=16, batch_size=16)
    trainer.fit(DVIRegressor(hidden=[4], lr=0.01), dm)
    assert spy.steps[0] is None and all(s is not None and s >= 1 for s in spy.steps[1:])
    with pytest.raises(ValueError, match="train_time_interval must be positive"):
        RunCheckpoint(train_time_interval=0)
    with pytest.raises(ValueError, match="every_n_epochs must be an int >= 0"):
        RunCheckpoint(every_n_epochs=-1)


def test_runs_never_overwrite_each_other(tmp_path):
    # a logger: one version directory per run
    first, _ = _fit(tmp_path / "logged", RunCheckpoint(), epochs=2)
    first_bytes = Path(first.checkpoint_callback.last_model_path).read_bytes()
    second, _ = _fit(tmp_path / "logged", RunCheckpoint(), epochs=1)
    assert Path(first.checkpoint_callback.last_model_path).read_bytes() == first_bytes
    assert "version_1" in second.checkpoint_callback.last_model_path
    assert find_last_checkpoint(second) == Path(second.checkpoint_callback.last_model_path)

    # no logger: <default_root_dir>/checkpoints/version_N
    runs = [_fit(tmp_path / "plain", RunCheckpoint(), logger=False, epochs=1)[0] for _ in "ab"]
    paths = [Path(t.checkpoint_callback.last_model_path) for t in runs]
    assert [p.parent.name for p in paths] == ["version_0", "version_1"]

    # an explicit directory: a file that exists when the run starts is never rewritten
    pinned = tmp_path / "pinned"
    _fit(tmp_path, RunCheckpoint(dirpath=str(pinned)), logger=False, epochs=1)
    kept = (pinned / "last.ckpt").read_bytes()
    two, _ = _fit(tmp_path, RunCheckpoint(dirpath=str(pinned)), logger=False, epochs=2)
    assert (pinned / "last.ckpt").read_bytes() == kept
    assert Path(two.checkpoint_callback.last_model_path) == pinned / "last-v1.ckpt"
    assert find_last_checkpoint(two) == (pinned / "last-v1.ckpt").resolve()


def test_progress_log_prints_plain_lines_with_the_loss_and_key_metric(tmp_path):
    stream = io.StringIO()
    seed_everything(0)
    trainer = cpu_trainer(
        default_root_dir=tmp_path,
        max_epochs=2,
        log_every_n_steps=1,
        enable_progress_bar=True,
        callbacks=[ProgressLog(every_n_seconds=1e-9, stream=stream)],
    )
    dm = ToyHeteroscedasticDataModule(num_train=48, num_val=16, num_test=16, batch_size=16)
    trainer.fit(DVIRegressor(hidden=[4], lr=0.01), dm)
    lines = stream.getvalue().splitlines()
    assert "\r" not in stream.getvalue()
    assert lines[0] == "fit: training, 3 batches per epoch; progress every 1e-09 s"
    assert lines[1].startswith("fit: epoch 1/2  step 1/6 (17%)  train/loss ")
    assert lines[-1].startswith("fit: done, epoch 2/2  step 6/6 (100%)  train/loss ")
    assert "val/nll " in lines[-1]
    assert len(lines) == 1 + 6 + 1  # one per step here (the interval is tiny), then the end
    with pytest.raises(ValueError, match="every_n_seconds must be > 0"):
        ProgressLog(every_n_seconds=0)


class _StopAfterFirstEpoch(Callback):
    def on_train_epoch_end(self, trainer, pl_module):
        trainer.should_stop = True


def test_progress_log_final_line_of_a_run_stopped_early_has_no_time_left(tmp_path):
    stream = io.StringIO()
    trainer = cpu_trainer(
        default_root_dir=tmp_path,
        max_epochs=50,
        enable_progress_bar=True,
        callbacks=[ProgressLog(every_n_seconds=1e-9, stream=stream), _StopAfterFirstEpoch()],
    )
    dm = ToyHeteroscedasticDataModule(num_train=48, num_val=16, num_test=16, batch_size=16)
    trainer.fit(DVIRegressor(hidden=[4], lr=0.01), dm)
    lines = stream.getvalue().splitlines()
    assert " s left" in lines[1]  # while it runs: the estimate for the planned 150 steps
    assert lines[-1].startswith("fit: done, epoch 1/50  step 3/150 (2%)")
    assert " s left" not in lines[-1]  # the run is over: nothing is left


@pytest.mark.parametrize(
    ("extra", "checkpoints", "progress"),
    [
        ([], [RunCheckpoint], [ProgressLog]),  # piped (pytest captures standard error)
        (["--trainer.enable_progress_bar", "false", "--trainer.enable_checkpointing", "false"],
         [], []),
        (["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks+=DVIProgressBar"],
         [ModelCheckpoint], [DVIProgressBar]),
    ],
    ids=["defaults", "disabled", "configured"],
)  # fmt: skip
def test_cli_defaults_add_a_run_checkpoint_and_progress(cli_workdir, extra, checkpoints, progress):
    config = cli_workdir / "bare.yaml"
    config.write_text(
        "model: {class_path: lightning_dvi.DVIRegressor, init_args: {hidden: [4]}}\n"
        "data: {class_path: lightning_dvi.data.ToyHeteroscedasticDataModule}\n"
    )
    trainer = cli(["--config", str(config), *extra], run=False).trainer
    found = [type(c) for c in trainer.callbacks if isinstance(c, ModelCheckpoint)]
    assert found == checkpoints
    bars = [type(c) for c in trainer.callbacks if isinstance(c, (ProgressLog, DVIProgressBar))]
    assert bars == progress
