"""2-process DDP (ddp_spawn on CPU, gloo) reaches what 1 process reaches for the same global batch.

Full-batch training makes the comparison exact up to float round-off: each DDP process averages
the per-datum ELBO over its half of the data, the gradient all-reduce averages the halves, and
that is the one-process gradient. Validation metrics are sum states reduced across processes.
"""

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything

from lightning_dvi import DVIRegressor
from lightning_dvi.callbacks import EmpiricalBayes, PointEstimateWarmStart
from lightning_dvi.data import ToyHeteroscedasticDataModule

NUM_TRAIN, NUM_VAL, STEPS = 64, 32, 6


def _fit(devices: int, warm_start: bool = False) -> tuple[DVIRegressor, dict[str, float]]:
    seed_everything(0)
    model = DVIRegressor(in_features=1, hidden=[8], mode="full", eb_mode="buffer", lr=0.02)
    # Per-process batch: the whole training set split over the processes (one step per epoch).
    dm = ToyHeteroscedasticDataModule(
        num_train=NUM_TRAIN, num_val=NUM_VAL, num_test=0, batch_size=NUM_TRAIN // devices
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp_spawn" if devices > 1 else "auto",
        max_epochs=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[
            EmpiricalBayes(every_n_steps=2),
            *([PointEstimateWarmStart(max_steps=5, iterations=5)] if warm_start else []),
        ],
    )
    trainer.fit(model, dm)
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    return model, metrics


@pytest.mark.parametrize("warm_start", [False, True], ids=["cold", "warm_start"])
def test_two_process_ddp_matches_one_process(monkeypatch, warm_start):
    """With the warm start, each process gathers both halves (train and validation) and fits
    the whole set, as one process does; a fit on its own half would give other means."""
    # Spawned workers read this before importing torch: one thread each on a 2-core machine.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    single_model, single = _fit(devices=1, warm_start=warm_start)
    # ddp_spawn copies rank 0's weights and metrics back
    ddp_model, ddp = _fit(devices=2, warm_start=warm_start)

    assert set(single) == set(ddp) and "val/nll" in ddp
    for key, value in single.items():
        assert ddp[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key
    for key, value in single_model.state_dict().items():
        torch.testing.assert_close(
            ddp_model.state_dict()[key], value, rtol=1e-4, atol=1e-5, msg=key
        )
