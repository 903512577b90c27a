"""RestoreBestWeights across a resume: the checkpoint carries the best weights of the whole run."""

from __future__ import annotations

import lightning
import torch
from helpers import cpu_trainer, overfit_loaders
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_dvi import DVIRegressor
from lightning_dvi.callbacks import RestoreBestWeights

EPOCHS = 12


def _model() -> DVIRegressor:
    lightning.seed_everything(0, verbose=False)
    return DVIRegressor(in_features=2, hidden=[64], num_data=15, optimizer="lbfgs")


def test_a_fit_resumed_after_its_best_epoch_still_ends_on_the_runs_best_weights(tmp_path):
    whole, restore = _model(), RestoreBestWeights("val/nll")
    saver = ModelCheckpoint(
        dirpath=tmp_path, filename="{epoch}", every_n_epochs=1, save_top_k=-1,
        save_on_train_epoch_end=True,
    )  # fmt: skip
    cpu_trainer(max_epochs=EPOCHS, num_sanity_val_steps=0, callbacks=[restore, saver]).fit(
        whole, *overfit_loaders()
    )
    best = restore.best_epoch
    assert best is not None and best < EPOCHS - 2  # the run goes on past its best epoch

    # resume from the checkpoint written one epoch after the best, with a fresh callback
    resumed, again = _model(), RestoreBestWeights("val/nll")
    cpu_trainer(
        max_epochs=EPOCHS, num_sanity_val_steps=0, callbacks=[again], enable_checkpointing=False
    ).fit(resumed, *overfit_loaders(), ckpt_path=tmp_path / f"epoch={best + 1}.ckpt")
    assert (again.best_epoch, again.best_score) == (best, restore.best_score)
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_a_new_fit_with_the_same_callback_forgets_the_previous_best():
    restore = RestoreBestWeights("val/nll")
    quiet = {"num_sanity_val_steps": 0, "callbacks": [restore], "enable_checkpointing": False}
    cpu_trainer(max_epochs=3, **quiet).fit(_model(), *overfit_loaders())
    first = restore.best_score
    # one L-BFGS iteration from the prior: a worse validation NLL than the first fit's best
    lightning.seed_everything(0, verbose=False)
    barely = DVIRegressor(in_features=2, hidden=[64], num_data=15, optimizer="lbfgs",
                          lbfgs_iterations=1)  # fmt: skip
    trainer = cpu_trainer(max_epochs=1, **quiet)
    trainer.fit(barely, *overfit_loaders())
    assert first is not None and float(trainer.callback_metrics["val/nll"]) > first
    assert restore.best_epoch == 0
    assert restore.best_score == float(trainer.callback_metrics["val/nll"])
