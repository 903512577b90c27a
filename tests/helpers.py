"""Plain helpers shared by several test modules (fixtures live in conftest.py)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer

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


def logit_grid(
    variances: tuple[float, ...], gaps: tuple[float, ...], classes: tuple[int, ...] = (2, 3, 10)
) -> Any:
    """``(K, v, mean, cov_for_the_api, full_cov)`` test points for categorical integrals (float64).

    For every class count, variance scale and mean gap: means spread over ``[0, gap]``, then a
    random diagonal covariance (``v`` times U(0.2, 1.8)) and a random correlated full one
    (``v A Aᵀ`` normalised to mean diagonal ``v``). Seeded: the same points every call.
    """
    f64 = torch.float64
    gen = torch.Generator().manual_seed(0)
    for k in classes:
        for v in variances:
            for gap in gaps:
                u = torch.rand(k, generator=gen, dtype=f64)
                mean = gap * (u - u.min()) / (u.max() - u.min())
                diag = v * (0.2 + 1.6 * torch.rand(k, generator=gen, dtype=f64))
                yield k, v, mean, diag, torch.diag(diag)
                a = torch.randn(k, k, generator=gen, dtype=f64)
                full = a @ a.T
                full = v * full / full.diagonal().mean()
                yield k, v, mean, full, full
