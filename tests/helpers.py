"""Plain helpers shared by several test modules (fixtures live in conftest.py)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from lightning.pytorch import Callback, Trainer

from lightning_dvi.nn import BayesLinear, mlp


def cpu_trainer(**overrides: Any) -> Trainer:
    """A quiet single-process CPU ``Trainer``: no logger, progress bar or model summary."""
    defaults: dict[str, Any] = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return Trainer(**{**defaults, **overrides})


class PoisonWeight(Callback):
    """Sets a weight to NaN after the given steps (a user's callbacks run before the
    ``LBFGSSupervisor`` the module adds, which then sees the non-finite weights)."""

    def __init__(self, steps: set[int]) -> None:
        self.steps = steps

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step in self.steps:
            with torch.no_grad():
                next(pl_module.parameters()).view(-1)[0] = math.nan


def posterior_net(dtype: torch.dtype = torch.float64) -> torch.nn.Module:
    """A 3-7-5-2 ``mlp`` whose posterior scales and biases are spread away from their init."""
    net = mlp(3, [7, 5], 2).to(dtype)
    with torch.no_grad():
        for layer in net.modules():
            if isinstance(layer, BayesLinear):
                layer.weight_raw_scale.normal_(-1.0, 0.5)
                layer.bias_raw_scale.normal_(-2.0, 0.5)
                layer.bias_loc.normal_(0, 0.3)
    return net


def logit_grid(seed: int, scales: tuple[float, ...], gaps: tuple[float, ...]) -> Any:
    """``(K, v, mean, cov_for_the_api, full_cov)`` over classes 2/3/10, logit variance scales,
    mean gaps and covariance kinds (a diag one, then a full one), float64, seeded."""
    f64 = torch.float64
    gen = torch.Generator().manual_seed(seed)
    for k in (2, 3, 10):
        for v in scales:
            for gap in gaps:
                u = torch.rand(k, generator=gen, dtype=f64)
                mean = gap * (u - u.min()) / (u.max() - u.min())
                diag = v * (0.2 + 1.6 * torch.rand(k, generator=gen, dtype=f64))
                yield k, v, mean, diag, torch.diag(diag)
                a = torch.randn(k, k, generator=gen, dtype=f64)
                full = a @ a.T
                full = v * full / full.diagonal().mean()
                yield k, v, mean, full, full


def log_softmax_draws(
    mean: torch.Tensor, full: torch.Tensor, draws: int, gen: torch.Generator
) -> torch.Tensor:
    """``log softmax(a)`` for ``draws`` draws ``a ~ N(mean, full)``, ``[draws, K]``."""
    k = mean.shape[-1]
    chol = torch.linalg.cholesky(full + 1e-12 * torch.eye(k, dtype=full.dtype))
    noise = torch.randn(draws, k, generator=gen, dtype=full.dtype)
    return torch.log_softmax(mean + noise @ chol.T, -1)


RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def load_recipe(name: str) -> ModuleType:
    """``recipes/<name>.py`` as a module, ``sys.path`` as it was (recipes add their folder)."""
    spec = importlib.util.spec_from_file_location(name, RECIPES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    path = list(sys.path)
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path[:] = path
    return module


def overfit_loaders() -> tuple[Any, Any]:
    """Training and validation loaders of a noisy sine (15 and 45 rows of 2 features).

    With a wide network (``overfit_fit``) the validation NLL turns up within a few L-BFGS steps:
    the early-stopping and weight-restoring callbacks' tests run on it.
    """
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(0)
    x = torch.randn(60, 2, generator=g)
    y = torch.sin(2 * x[:, 0]) + 0.3 * torch.randn(60, generator=g)
    return (
        DataLoader(TensorDataset(x[:15], y[:15]), batch_size=15),
        DataLoader(TensorDataset(x[15:], y[15:]), batch_size=45),
    )


def overfit_fit(callbacks: list[Callback], epochs: int = 12) -> Any:
    """A seeded ``DVIRegressor(hidden=[64], optimizer="lbfgs")`` fit on ``overfit_loaders``."""
    import lightning

    from lightning_dvi import DVIRegressor

    lightning.seed_everything(0, verbose=False)
    model = DVIRegressor(in_features=2, hidden=[64], num_data=15, optimizer="lbfgs")
    trainer = cpu_trainer(
        max_epochs=epochs, num_sanity_val_steps=0, callbacks=callbacks, enable_checkpointing=False
    )
    trainer.fit(model, *overfit_loaders())
    return model
