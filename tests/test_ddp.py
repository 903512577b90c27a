"""2-process DDP (gloo on CPU) reaches what 1 process reaches for the same global batch.

Full-batch training makes the comparison exact up to float round-off: each DDP process averages
the per-datum ELBO over its half of the data, the gradient all-reduce averages the halves, and
that is the one-process gradient. Validation metrics are sum states reduced across processes.

One run starts its processes by ``spawn`` (``ddp_spawn``: the model, data module and callbacks
travel pickled to fresh interpreters); the others by ``fork`` (``ddp_fork``), which runs the
same training and collectives without each process re-importing torch and Lightning first
(~7 s of CPU per process).
"""

from datetime import timedelta
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.strategies import DDPStrategy

from lightning_dvi import DVIRegressor
from lightning_dvi.callbacks import EmpiricalBayes, PointEstimateWarmStart
from lightning_dvi.data import ToyHeteroscedasticDataModule

NUM_TRAIN, NUM_VAL, STEPS = 64, 32, 6
# L-BFGS amplifies float32 round-off (the mean of two shard losses is not bit-equal to the
# global mean): after 1/3/6 steps of 5 iterations the processes' weights differ from one
# process's by 2e-5/1e-3/9e-2. Two steps keep the comparison meaningful.
LBFGS_STEPS, LBFGS_TOL = 2, 2e-3


def _trainer(devices: int, start_method: str = "fork", **kwargs: Any) -> Trainer:
    """A quiet CPU trainer, 2 processes (started by ``start_method``) when ``devices > 1``."""
    return Trainer(
        accelerator="cpu",
        devices=devices,
        # a collective that one process never reaches fails after the timeout instead of hanging
        strategy=DDPStrategy(start_method=start_method, timeout=timedelta(seconds=120))
        if devices > 1
        else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def _fit(
    devices: int, warm_start: bool = False, optimizer: str = "adam", start_method: str = "fork"
) -> tuple[DVIRegressor, dict[str, float]]:
    seed_everything(0)
    model = DVIRegressor(
        in_features=1, hidden=[8], mode="full", eb_mode="buffer", lr=0.02, optimizer=optimizer,
        lbfgs_iterations=5,
    )  # fmt: skip
    # Per-process batch: the whole training set split over the processes (one step per epoch).
    dm = ToyHeteroscedasticDataModule(
        num_train=NUM_TRAIN, num_val=NUM_VAL, num_test=0, batch_size=NUM_TRAIN // devices
    )
    trainer = _trainer(
        devices,
        start_method,
        max_epochs=STEPS if optimizer == "adam" else LBFGS_STEPS,
        num_sanity_val_steps=0,
        callbacks=[
            EmpiricalBayes(every_n_steps=2),
            *([PointEstimateWarmStart(max_steps=5, iterations=5)] if warm_start else []),
        ],
    )
    trainer.fit(model, dm)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    return model, metrics


@pytest.mark.parametrize(
    ("warm_start", "optimizer", "start_method"),
    [(False, "adam", "spawn"), (True, "adam", "fork"), (True, "lbfgs", "fork")],
    ids=["cold", "warm_start", "warm_start_lbfgs"],
)
def test_two_process_ddp_matches_one_process(monkeypatch, warm_start, optimizer, start_method):
    """With the warm start, each process gathers both halves (train and validation) and fits
    the whole set, as one process does; a fit on its own half would give other means. Under
    L-BFGS (the recipes' protocol) the line search compares the global loss on every process,
    not each shard's own."""
    # Spawned workers read this before importing torch: one thread each on a 2-core machine.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    single_model, single = _fit(devices=1, warm_start=warm_start, optimizer=optimizer)
    # the launcher copies rank 0's weights and metrics back
    ddp_model, ddp = _fit(2, warm_start, optimizer, start_method)

    rtol, atol = (1e-4, 1e-5) if optimizer == "adam" else (LBFGS_TOL, LBFGS_TOL)
    assert set(single) == set(ddp) and "val/nll" in ddp
    for key, value in single.items():
        assert ddp[key] == pytest.approx(value, rel=rtol, abs=atol), key
    for key, value in single_model.state_dict().items():
        torch.testing.assert_close(
            ddp_model.state_dict()[key], value, rtol=rtol, atol=atol, msg=key
        )


class _Pairs(torch.utils.data.Dataset):
    """Not a TensorDataset: the targets can only be read by iterating a loader."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def _fit_plain(devices: int) -> DVIRegressor:
    """A fit given plain loaders (no datamodule): the model reads them in ``setup``."""
    from torch.utils.data import DataLoader

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(NUM_TRAIN, 2, generator=gen)
    y = 5.0 + 3.0 * x[:, 0] + 0.5 * torch.randn(NUM_TRAIN, generator=gen)
    seed_everything(0)
    # built up front: the launcher copies rank 0's state back into this object
    model = DVIRegressor(in_features=2, hidden=[8], mode="full", lr=0.02)
    trainer = _trainer(devices, max_epochs=3)
    loader = DataLoader(_Pairs(x, y), batch_size=NUM_TRAIN // devices)
    trainer.fit(model, train_dataloaders=loader)
    return model


def test_plain_loaders_under_ddp_give_every_process_the_whole_training_set(monkeypatch):
    """Each process reads the whole training set in ``setup`` (not its sampler's shard), so the
    target statistics and the data size are the one-process ones and the fits agree."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    single, ddp = _fit_plain(1), _fit_plain(2)
    assert single.num_data == NUM_TRAIN
    for key, value in single.state_dict().items():
        torch.testing.assert_close(ddp.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key)
