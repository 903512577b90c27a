r"""Normalization moments against Monte Carlo: the LayerNorm grid and the batch-norm train rule.

``python -m lightning_dvi_benchmarks.normalization`` prints the tables of ``docs/moments.md``
("Normalization layers").

**LayerNorm grid.** For widths ``D`` and ratios (mean input variance over the spread of the
means, which are standard normal), four inputs :math:`a \sim \mathcal N(\mu, \Sigma)` per
cell with a diagonal :math:`\Sigma` (variances ``ratio`` times U(0.2, 1.8)) or a full one
(``ratio`` times a random correlated matrix with unit mean diagonal); the closed forms
(:func:`lightning_dvi.moments.normalize_diag`, :func:`~lightning_dvi.moments.normalize_full`)
and, for contrast, the plug-in rule (statistics replaced by their expectations, as
sampling-free peers do) against Monte Carlo of ``torch.nn.functional.layer_norm``: the largest
absolute error of the means (outputs are O(1)), the largest relative error of the variances,
and (full) the largest covariance error over the largest variance.

**Batch-norm train rule.** Four rules (:mod:`lightning_dvi.moments.normalization`):
``"delta"`` (second-order delta method in the fluctuation of the batch statistics),
``"independent"`` (exact quadrature), ``"total"`` (constant statistics: variance of the means
plus the mean variance) and ``"means"`` (variance of the means only). Each is compared with
Monte Carlo of what a sampled network computes, in two settings:

* ``independent``: the batch holds independent Gaussians :math:`a_k \sim \mathcal N(m_k, v_k)`
  (a layer-level oracle): every draw is normalized by torch's ``batch_norm`` with its own batch
  statistics, and the per-example mean and standard deviation of the output are compared with
  the rule's Gaussian;
* ``network``: a DVI network ``BayesLinear -> BatchNorm1d`` (and a deeper one with a ReLU and a
  second layer) in train mode, whose examples share each weight draw (their activations are
  correlated across the batch), against :func:`~lightning_dvi.diagnostics.compare_with_monte_carlo`.

A third table sweeps the values per channel :math:`n` (the batch of the ``independent``
setting, worst over its ratios): the ``"delta"`` expansion needs :math:`n \ge 16`, below which
the rule takes the exact route. Errors are the largest over examples and units: the mean error
in MC standard deviations and the relative error of the standard deviation.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from lightning_dvi.diagnostics import compare_with_monte_carlo
from lightning_dvi.moments import layer_norm as L
from lightning_dvi.moments import normalization as N
from lightning_dvi.moments.normalization import BatchRule
from lightning_dvi.nn import BatchNorm1d, BayesLinear, ReLU, Sequential

__all__ = [
    "GridError",
    "RuleError",
    "batch_rule_independent",
    "batch_rule_network",
    "batch_size_sweep",
    "gaussian_monte_carlo",
    "layer_norm_cell",
    "main",
]

RULES: tuple[BatchRule, ...] = ("delta", "independent", "total", "means")
RATIOS = (0.01, 0.1, 1.0, 10.0)
SCALES = (0.03, 0.1, 0.3, 1.0)
WIDTHS = (4, 16, 64, 256)
GRID_RATIOS = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
KINDS = ("diag", "full")


@dataclass(frozen=True)
class GridError:
    """One LayerNorm grid cell: errors of the closed form and of the plug-in rule vs MC."""

    width: int
    ratio: float
    kind: str
    mean_error: float
    var_rel_error: float
    cov_error: float
    plugin_mean_error: float
    plugin_var_rel_error: float


def _gaussian_input(
    width: int, ratio: float, kind: str, gen: torch.Generator, batch: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    mean = torch.randn(batch, width, generator=gen, dtype=torch.float64)
    if kind == "diag":
        var = ratio * (0.2 + 1.6 * torch.rand(batch, width, generator=gen, dtype=torch.float64))
        return mean, torch.diag_embed(var)
    a = torch.randn(batch, width, width, generator=gen, dtype=torch.float64)
    cov = a @ a.mT / width + 0.1 * torch.eye(width, dtype=torch.float64)
    cov = cov / torch.diagonal(cov, 0, -2, -1).mean(-1)[:, None, None]
    return mean, ratio * cov


def gaussian_monte_carlo(
    fn: Callable[[torch.Tensor], torch.Tensor],
    mean: torch.Tensor,
    cov: torch.Tensor,
    draws: int,
    gen: torch.Generator,
    chunk: int = 10_000,
) -> tuple[torch.Tensor, torch.Tensor]:
    """MC mean ``[B, D']`` and covariance ``[B, D', D']`` of ``fn(a)``, ``a ~ N(mean, cov)``.

    The oracle of the closed forms (in the style of GPyTorch's likelihood tests): draw inputs
    from the Gaussian ``[B, D]``, apply the torch function to ``[n, B, D]`` draws, accumulate
    first and second moments in chunks of ``chunk`` draws.
    """
    chol = torch.linalg.cholesky(cov)
    total: torch.Tensor | None = None
    outer: torch.Tensor | None = None
    done = 0
    while done < draws:
        n = min(chunk, draws - done)
        noise = torch.randn(n, *mean.shape, generator=gen, dtype=mean.dtype)
        y = fn(mean + torch.einsum("nbj,bij->nbi", noise, chol))  # [n, B, D']
        part, part_outer = y.sum(0), torch.einsum("nbi,nbj->bij", y, y)
        total = part if total is None else total + part
        outer = part_outer if outer is None else outer + part_outer
        done += n
    assert total is not None and outer is not None
    mc_mean = total / draws
    mc_cov = (outer - draws * mc_mean.unsqueeze(-1) * mc_mean.unsqueeze(-2)) / (draws - 1)
    return mc_mean, mc_cov


def _plugin(mean: torch.Tensor, cov: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Statistics replaced by their expectations: an affine map of the Gaussian."""
    d = mean.shape[-1]
    m = mean - mean.mean(-1, keepdim=True)
    centred = cov - cov.mean(-1, keepdim=True)
    centred = centred - centred.mean(-2, keepdim=True)
    var = torch.diagonal(centred, 0, -2, -1)
    s_bar = (m * m).mean(-1, keepdim=True) + var.sum(-1, keepdim=True) / d + eps
    return m / s_bar.sqrt(), var / s_bar


def layer_norm_cell(
    width: int, ratio: float, kind: str, *, draws: int = 200_000, seed: int = 0, eps: float = 1e-5
) -> GridError:
    """The closed form and the plug-in rule against Monte Carlo in one grid cell."""
    gen = torch.Generator().manual_seed(seed)
    mean, cov = _gaussian_input(width, ratio, kind, gen)
    if kind == "diag":
        out_mean, out_var = L.normalize_diag(mean, torch.diagonal(cov, 0, -2, -1), eps)
        out_cov = None
    else:
        out_mean, out_cov = L.normalize_full(mean, cov, eps)
        out_var = torch.diagonal(out_cov, 0, -2, -1)
    mc_mean, mc_cov = gaussian_monte_carlo(
        lambda a: F.layer_norm(a, a.shape[-1:], eps=eps), mean, cov, draws, gen
    )
    mc_var = torch.diagonal(mc_cov, 0, -2, -1)
    p_mean, p_var = _plugin(mean, cov, eps)
    cov_error = float("nan")
    if out_cov is not None:
        cov_error = ((out_cov - mc_cov).abs().amax((-2, -1)) / mc_var.amax(-1)).max().item()
    return GridError(
        width,
        ratio,
        kind,
        (out_mean - mc_mean).abs().max().item(),
        (out_var / mc_var - 1).abs().max().item(),
        cov_error,
        (p_mean - mc_mean).abs().max().item(),
        (p_var / mc_var - 1).abs().max().item(),
    )


def _grid_table(rows: list[GridError]) -> str:
    lines = [
        "| D | ratio | Σ | mean error | var rel. error | cov error | plug-in mean error | "
        "plug-in var rel. error |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r.width} | {r.ratio:g} | {r.kind} | {r.mean_error:.4f} | {r.var_rel_error:.4f} | "
        f"{'-' if r.kind == 'diag' else f'{r.cov_error:.4f}'} | {r.plugin_mean_error:.4f} | "
        f"{r.plugin_var_rel_error:.4f} |"
        for r in rows
    ]
    return "\n".join(lines)


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
    seed: int = 0, expansion_only: bool = False,
) -> RuleError:  # fmt: skip
    r"""Rule vs Monte Carlo on a batch of independent Gaussians with variance/spread ``ratio``.

    Means :math:`m_k \sim \mathcal N(0, 1)`, variances ``ratio`` times U(0.5, 1.5), so the mean
    input variance over the variance of the means is about ``ratio``. ``expansion_only``: the
    ``"delta"`` expansion also below 16 values (no exact route; the row is labelled so).
    """
    gen = torch.Generator().manual_seed(seed)
    mean = torch.randn(batch, channels, generator=gen, dtype=torch.float64)
    var = ratio * (0.5 + torch.rand(batch, channels, generator=gen, dtype=torch.float64))
    if rule in ("delta", "independent"):
        m, v, _ = N.batch_normalize(
            mean, var, 1e-5, rule, 0 if expansion_only else N.DELTA_MIN_VALUES
        )
    else:
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
        f"{rule} (expansion)" if expansion_only else rule,
        ((m - mc_mean).abs() / mc_std).max().item(),
        (v.sqrt() / mc_std - 1).abs().max().item(),
    )


BATCHES = (8, 12, 16, 32, 128)


def batch_size_sweep(
    rule: BatchRule, batch: int, *, draws: int = 20_000, expansion_only: bool = False
) -> RuleError:
    """The worst errors of ``rule`` over :data:`RATIOS` for ``batch`` values per channel."""
    rows = [
        batch_rule_independent(r, rule, batch=batch, draws=draws, expansion_only=expansion_only)
        for r in RATIOS
    ]
    return RuleError(
        "independent",
        batch,
        rows[0].rule,
        max(r.mean_error for r in rows),
        max(r.std_rel_error for r in rows),
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
    parser.add_argument("--draws", type=int, default=20_000, help="batch-norm rule draws")
    parser.add_argument("--grid-draws", type=int, default=200_000, help="LayerNorm grid draws")
    parser.add_argument("--skip-grid", action="store_true")
    args = parser.parse_args(argv)
    if not args.skip_grid:
        cells = [
            layer_norm_cell(d, r, k, draws=args.grid_draws, seed=i)
            for i, (k, d, r) in enumerate(
                (k, d, r) for k in KINDS for d in WIDTHS for r in GRID_RATIOS
            )
        ]
        print(_grid_table(cells))
        print()
    rows = [batch_rule_independent(r, rule, draws=args.draws) for r in RATIOS for rule in RULES]
    print(_table(rows, "input var / var of means"))
    rows = [
        batch_size_sweep(rule, b, draws=args.draws, expansion_only=rule == "delta")
        for b in BATCHES
        for rule in ("delta", "independent", "total")
    ]
    print()
    print(_table(rows, "values per channel n"))
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
