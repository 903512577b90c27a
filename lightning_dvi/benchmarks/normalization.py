r"""Normalization moments against Monte Carlo: the train-mode batch-norm rule.

``python -m lightning_dvi.benchmarks.normalization`` prints the tables of ``docs/moments.md``
("Normalization layers").

**Batch-norm train rule.** Two rules form train-mode statistics from propagated moments
(:func:`lightning_dvi.moments.batch_norm_statistics`): ``"total"`` (variance of the means plus
the mean variance) and ``"means"`` (variance of the means only). Each is compared with Monte
Carlo of what a sampled network computes, in two settings:

* ``independent``: the batch holds independent Gaussians :math:`a_k \sim \mathcal N(m_k, v_k)`
  (a layer-level oracle): every draw is normalized by torch's ``batch_norm`` with its own batch
  statistics, and the per-example mean and standard deviation of the output are compared with
  the rule's Gaussian;
* ``network``: a DVI network ``BayesLinear -> BatchNorm1d`` (and a deeper one with a ReLU and a
  second layer) in train mode, whose examples share each weight draw (their activations are
  correlated across the batch), against :func:`~lightning_dvi.diagnostics.compare_with_monte_carlo`.

Errors are the largest over examples and units: the mean error in MC standard deviations and
the relative error of the standard deviation.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..diagnostics import compare_with_monte_carlo
from ..moments import normalization as N
from ..moments.normalization import BatchRule
from ..nn import BatchNorm1d, BayesLinear, ReLU, Sequential

__all__ = ["RuleError", "batch_rule_independent", "batch_rule_network", "main"]

RULES: tuple[BatchRule, ...] = ("total", "means")
RATIOS = (0.01, 0.1, 1.0, 10.0)
SCALES = (0.03, 0.1, 0.3, 1.0)


@dataclass(frozen=True)
class RuleError:
    """One cell of the rule table: the worst mean error (MC stds) and std relative error."""

    setting: str
    level: float
    rule: str
    mean_error: float
    std_rel_error: float


def batch_rule_independent(
    ratio: float, rule: BatchRule, *, batch: int = 32, channels: int = 4, draws: int = 20_000,
    seed: int = 0,
) -> RuleError:  # fmt: skip
    r"""Rule vs Monte Carlo on a batch of independent Gaussians with variance/spread ``ratio``.

    Means :math:`m_k \sim \mathcal N(0, 1)`, variances ``ratio`` times U(0.5, 1.5), so the mean
    input variance over the variance of the means is about ``ratio``.
    """
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(batch, channels, generator=gen, dtype=torch.float64)
    var = ratio * (0.5 + torch.rand(batch, channels, generator=gen, dtype=torch.float64))
    mu, sigma2 = N.batch_norm_statistics(mean, var, (0,), rule)
    scale, shift = N.normalization_scale_shift(mu, sigma2, None, None, 1e-5)
    m, v = N.affine_diag(mean, var, scale, shift)
    a = mean + var.sqrt() * torch.randn(draws, batch, channels, generator=gen, dtype=torch.float64)
    y = F.batch_norm(
        a.transpose(0, 1).reshape(batch, draws * channels), None, None, training=True, eps=1e-5
    ).reshape(batch, draws, channels)
    mc_mean, mc_std = y.mean(1), y.std(1)
    return RuleError(
        "independent",
        ratio,
        rule,
        ((m - mc_mean).abs() / mc_std).max().item(),
        (v.sqrt() / mc_std - 1).abs().max().item(),
    )


def batch_rule_network(
    scale: float, rule: BatchRule, *, deep: bool = False, draws: int = 20_000, seed: int = 0
) -> RuleError:
    """Rule vs Monte Carlo in a DVI network (train mode) with posterior std ``scale``."""
    torch.manual_seed(seed)
    layers = [BayesLinear(5, 8, init_scale=scale), BatchNorm1d(8, batch_rule=rule)]
    if deep:
        layers += [ReLU(), BayesLinear(8, 2, init_scale=scale)]
    net = Sequential(*layers).double().train()
    x = torch.randn(32, 5, dtype=torch.float64)
    torch.manual_seed(seed + 1)
    res = compare_with_monte_carlo(net, x, mode="diag", num_samples=draws)
    name = "network (deep)" if deep else "network"
    return RuleError(name, scale, rule, res.mean_error, res.std_rel_error)


def _table(rows: list[RuleError], level: str) -> str:
    lines = [
        f"| setting | {level} | rule | mean error (MC sd) | std rel. error |",
        "|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.setting} | {r.level:g} | {r.rule} | {r.mean_error:.3f} | {r.std_rel_error:.3f} |"
        for r in rows
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Print the batch-norm rule tables (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20_000)
    args = parser.parse_args(argv)
    rows = [batch_rule_independent(r, rule, draws=args.draws) for r in RATIOS for rule in RULES]
    print(_table(rows, "input var / var of means"))
    rows = [
        batch_rule_network(s, rule, deep=deep, draws=args.draws)
        for deep in (False, True)
        for s in SCALES
        for rule in RULES
    ]
    print()
    print(_table(rows, "posterior std"))


if __name__ == "__main__":
    main()
