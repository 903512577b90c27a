r"""The paper's toy 1-D heteroscedastic regression data (section 3.1, Fig. 2), made in code.

:math:`x \sim U(-\tfrac12, \tfrac12)`, :math:`y = -(x + \tfrac12)\sin(3\pi x) + \epsilon` with
:math:`\epsilon \sim \mathcal N(0, s(x)^2)`, :math:`s(x) = 0.45\,(x + \tfrac12)^2`: the noise grows
from 0 at the left edge to 0.45 at the right, as in the authors' toy experiment.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["make_toy_heteroscedastic", "toy_mean", "toy_noise_std", "toy_true_log_likelihood"]


def toy_mean(x: Tensor) -> Tensor:
    r"""The noiseless regression function :math:`-(x + 1/2)\sin(3\pi x)`."""
    return -(x + 0.5) * torch.sin(3 * math.pi * x)


def toy_noise_std(x: Tensor) -> Tensor:
    """The true noise standard deviation :math:`0.45 (x + 1/2)^2`."""
    return 0.45 * (x + 0.5) ** 2


def make_toy_heteroscedastic(
    n: int = 500, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[Tensor, Tensor]:
    """Draw ``n`` points ``(x [n, 1], y [n])`` with a seeded generator (no global RNG use)."""
    if n < 1:
        raise ValueError(f"n must be positive, got {n}")
    gen = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 1, generator=gen, dtype=torch.float64) - 0.5
    eps = torch.randn(n, generator=gen, dtype=torch.float64)
    y = toy_mean(x[:, 0]) + toy_noise_std(x[:, 0]) * eps
    return x.to(dtype), y.to(dtype)


def toy_true_log_likelihood(x: Tensor, y: Tensor) -> Tensor:
    """Mean log-density of ``y`` under the true noise model: the ceiling a fit can reach."""
    std = toy_noise_std(x.reshape(-1).double()).clamp_min(1e-12)
    dist = torch.distributions.Normal(toy_mean(x.reshape(-1).double()), std)
    log_prob: Tensor = dist.log_prob(y.reshape(-1).double())
    return log_prob.mean()
