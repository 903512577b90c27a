"""Monte Carlo references for checking moment propagation (used by tests and recipes)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from .gaussian import Gaussian, Mode
from .nn.base import BayesModule
from .propagation import sample_propagation

__all__ = ["FidelityResult", "compare_with_monte_carlo", "monte_carlo_moments"]


@torch.no_grad()
def monte_carlo_moments(
    net: BayesModule,
    x: Tensor,
    num_samples: int = 20_000,
    chunk_size: int = 1_000,
    sample_mode: Literal["sample", "local"] = "sample",
) -> tuple[Tensor, Tensor]:
    r"""Mean ``[B, D]`` and covariance ``[B, D, D]`` of the output over weight draws.

    Runs ``net(x, mode=sample_mode)`` in chunks (memory is :math:`O(\text{chunk}\cdot|W|)`)
    and accumulates first and second moments in float64. ``"sample"`` draws whole weights,
    shared by the examples of the batch; ``"local"`` (local reparameterisation) draws each
    example's units independently, which is the semantics of per-example moments where a layer
    couples the examples (train-mode batch normalization: its moments treat the examples of
    a batch as independent Gaussians).
    """
    draws = sample_propagation(sample_mode, "sample_mode")
    if num_samples < 2:
        raise ValueError(f"num_samples must be >= 2, got {num_samples}")
    total: Tensor | None = None
    outer: Tensor | None = None
    done = 0
    while done < num_samples:
        s = min(chunk_size, num_samples - done)
        f = net(x, mode=draws.draws(s)).double()  # [s, B, D]
        part, part_outer = f.sum(0), torch.einsum("sbi,sbj->bij", f, f)
        total = part if total is None else total + part
        outer = part_outer if outer is None else outer + part_outer
        done += s
    assert total is not None and outer is not None  # num_samples >= 2: the loop ran
    mean = total / num_samples
    cov = (outer - num_samples * mean.unsqueeze(-1) * mean.unsqueeze(-2)) / (num_samples - 1)
    return mean, cov


@dataclass(frozen=True)
class FidelityResult:
    """Errors of a propagated Gaussian against Monte Carlo, in units of the MC std.

    Attributes:
        mean_error: max over outputs of ``|mean - mean_mc| / std_mc``.
        std_rel_error: max over outputs of ``|std / std_mc - 1|``.
        corr_error: max absolute error of the output correlations (full mode only, else nan).
    """

    mean_error: float
    std_rel_error: float
    corr_error: float


def compare_with_monte_carlo(
    net: BayesModule,
    x: Tensor,
    mode: Mode = "full",
    num_samples: int = 20_000,
    chunk_size: int = 1_000,
    sample_mode: Literal["sample", "local"] = "sample",
) -> FidelityResult:
    """Propagate ``x`` in ``mode`` and compare with :func:`monte_carlo_moments` (``sample_mode``)."""
    with torch.no_grad():
        out = net(x, mode=mode)
    if not isinstance(out, Gaussian):
        raise ValueError("the network output is deterministic; nothing to compare")
    mc_mean, mc_cov = monte_carlo_moments(net, x, num_samples, chunk_size, sample_mode)
    mc_std = mc_cov.diagonal(dim1=-2, dim2=-1).clamp_min(1e-300).sqrt()
    mean_err = ((out.mean.double() - mc_mean).abs() / mc_std).max().item()
    std_err = (out.stddev.double() / mc_std - 1).abs().max().item()
    corr_err = float("nan")
    if out.cov is not None:
        outer = mc_std.unsqueeze(-1) * mc_std.unsqueeze(-2)
        sd = out.stddev.double().clamp_min(1e-300)
        corr = out.cov.double() / (sd.unsqueeze(-1) * sd.unsqueeze(-2))
        corr_err = (corr - mc_cov / outer).abs().max().item()
    return FidelityResult(mean_err, std_err, corr_err)
