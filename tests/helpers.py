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
