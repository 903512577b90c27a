"""Checkpoints: weights_only loading, load_from_checkpoint, and exact resume with fit(ckpt_path="last")."""

import pytest
import torch
from helpers import cpu_trainer
from lightning.pytorch import Callback, seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.callbacks import EmpiricalBayes
from lightning_dvi.data import ToyHeteroscedasticDataModule


class ShiftedToy(ToyHeteroscedasticDataModule):
    """Toy data with non-trivial target statistics, to check they travel with the checkpoint."""

    target_loc_value, target_scale_value = 2.5, 3.0

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.target_loc, self.target_scale = self.target_loc_value, self.target_scale_value


def _toy(cls=ToyHeteroscedasticDataModule):
    return cls(num_train=48, num_val=16, num_test=16, batch_size=16, seed=3)


def _trainer(tmp_path, callbacks, **kwargs):
    return cpu_trainer(default_root_dir=tmp_path, callbacks=callbacks, **kwargs)


def _model(**kwargs):
    return DVIRegressor(
        in_features=1,
        hidden=[8],
        eb_mode="buffer",
        kl_warmup_steps=2,
        kl_anneal_steps=3,
        lr=0.01,
        **kwargs,
    )


def _checkpoint(tmp_path):
    return ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True, save_top_k=0)


def test_load_from_checkpoint_restores_buffers_and_target_statistics(tmp_path):
    seed_everything(0)
    model = _model()
    dm = _toy(ShiftedToy)
    _trainer(tmp_path, [EmpiricalBayes(every_n_steps=2), _checkpoint(tmp_path)], max_epochs=2).fit(
        model, dm
    )
    path = tmp_path / "ckpt" / "last.ckpt"

    raw = torch.load(path, weights_only=True)  # primitive hparams, tensors, plain containers
    assert raw["hyper_parameters"]["target_loc"] == 2.5
    assert raw["hyper_parameters"]["num_data"] == 48
    state = raw["state_dict"]
    assert float(state["target_scale"]) == 3.0
    assert float(state["net.layers.0.weight_prior_variance"]) != 1.0  # refreshed by the callback

    loaded = DVIRegressor.load_from_checkpoint(path)  # torch's default weights_only=True
    for key, value in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[key], value, rtol=0, atol=0)
    assert (loaded.num_data, loaded.mode) == (48, "full")
    x = torch.linspace(-0.5, 0.5, 7).unsqueeze(-1)
    for a, b in zip(loaded.predictive(x), model.predictive(x), strict=True):
        torch.testing.assert_close(a, b)


def test_classifier_checkpoint_loads_weights_only(tmp_path):
    model = DVIClassifier(in_features=3, num_classes=4, hidden=[5], num_data=10, eb_mode="buffer")
    trainer = _trainer(tmp_path, [])
    trainer.strategy.connect(model)
    trainer.save_checkpoint(tmp_path / "c.ckpt")
    loaded = DVIClassifier.load_from_checkpoint(tmp_path / "c.ckpt", weights_only=True)
    assert loaded.num_classes == 4 and loaded.hparams.hidden == [5]


class CountSteps(Callback):
    def __init__(self):
        self.batches = 0

    def on_train_batch_end(self, *args):
        self.batches += 1


def _run(tmp_path, max_epochs, ckpt_path=None, seed=0):
    seed_everything(seed)
    model = _model()
    eb, counter = EmpiricalBayes(every_n_steps=2, warmup_steps=1), CountSteps()
    trainer = _trainer(tmp_path, [eb, counter, _checkpoint(tmp_path)], max_epochs=max_epochs)
    trainer.fit(model, _toy(), ckpt_path=ckpt_path)
    return model, eb, trainer, counter.batches


def _assert_same_run(full_model, full_trainer, resumed_model, resumed_trainer):
    """Bit-identical parameters and validation metrics (tolerance 0)."""
    for key, value in full_model.state_dict().items():
        torch.testing.assert_close(resumed_model.state_dict()[key], value, rtol=0, atol=0, msg=key)
    for key in ("val/nll", "val/elbo", "val/rmse"):
        torch.testing.assert_close(
            resumed_trainer.callback_metrics[key],
            full_trainer.callback_metrics[key],
            rtol=0,
            atol=0,
        )


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path):
    full_model, full_eb, full_trainer, _ = _run(tmp_path / "full", max_epochs=4)

    _run(tmp_path / "split", max_epochs=2)  # "interrupted" after 2 epochs (6 steps)
    # A differently seeded fresh module: everything must come from the checkpoint.
    resumed_model, resumed_eb, resumed_trainer, batches = _run(
        tmp_path / "split", max_epochs=4, ckpt_path="last", seed=123
    )

    assert batches == 6  # only epochs 2 and 3 ran
    assert resumed_trainer.global_step == full_trainer.global_step == 12
    assert (resumed_eb.num_refreshes, resumed_eb.last_refresh_step) == (
        full_eb.num_refreshes,
        full_eb.last_refresh_step,
    )
    _assert_same_run(full_model, full_trainer, resumed_model, resumed_trainer)


class CrashError(RuntimeError):
    pass


class KillAtStep(Callback):
    """Simulates a crash: raises mid-epoch, before that step's checkpoint is written."""

    def __init__(self, step):
        self.step = step

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.step:
            raise CrashError(f"killed at step {self.step}")


def _run_steps(root, max_epochs, callbacks=(), ckpt_path=None, seed=0):
    seed_everything(seed)
    model = _model()
    checkpoint = ModelCheckpoint(
        dirpath=root / "ckpt", save_last=True, save_top_k=0, every_n_train_steps=1
    )
    trainer = _trainer(
        root, [EmpiricalBayes(every_n_steps=2), *callbacks, checkpoint], max_epochs=max_epochs
    )
    trainer.fit(model, _toy(), ckpt_path=ckpt_path)
    return model, trainer


def test_killed_mid_epoch_resumes_from_last_ckpt_exactly(tmp_path, recwarn):
    # 3 batches per epoch; the crash comes at global step 5, i.e. after 2 of epoch 1's batches,
    # and last.ckpt holds step 4 (1 batch into epoch 1).
    full_model, full_trainer = _run_steps(tmp_path / "full", max_epochs=3)
    with pytest.raises(CrashError):
        _run_steps(tmp_path / "crash", max_epochs=3, callbacks=[KillAtStep(5)])
    last = torch.load(tmp_path / "crash" / "ckpt" / "last.ckpt", weights_only=True)
    assert (last["global_step"], last["epoch"]) == (4, 1)
    resumed_model, resumed_trainer = _run_steps(
        tmp_path / "crash", max_epochs=3, ckpt_path="last", seed=123
    )
    assert resumed_trainer.global_step == full_trainer.global_step == 9
    _assert_same_run(full_model, full_trainer, resumed_model, resumed_trainer)
    assert not any("ended before the epoch ended" in str(w.message) for w in recwarn)
