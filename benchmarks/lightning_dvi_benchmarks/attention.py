r"""Attention-weight rules against Monte Carlo over weights and inputs (``docs/transformers.md``).

``python -m lightning_dvi_benchmarks.attention`` prints the table; with ``--cost B T D H`` it
prints each rule's CPU time per ``diag`` forward instead (:func:`rule_cost`); with ``--skip``
the skip rules' table (:func:`skip_cell`).

One multi-head self-attention layer (:func:`lightning_dvi.moments.attention.self_attention_moments`)
with ``T = 6`` tokens of width ``D = 8``, ``H = 2`` heads, causal; projection weight means
:math:`\mathcal N(0, 1/D)` and bias means :math:`\mathcal N(0, 0.1^2)` (scores of order one, as
after a LayerNorm); every weight and bias has posterior standard deviation ``weight_std``;
token means standard normal, token variances ``input_var`` (independent tokens and units).
Monte Carlo draws whole weights and inputs (:func:`~lightning_dvi.moments.attention.attention_sample`,
``draws`` draws, float64) and each rule's ``diag`` moments are compared output by output:

* the mean error in Monte Carlo standard deviations, :math:`|\mu - \hat\mu|/\hat\sigma`;
* the relative error of the standard deviation, :math:`|\sigma/\hat\sigma - 1|`;

as the mean and the largest over the ``batch x T x D`` outputs, averaged over ``seeds``
independent layers. (With 20,000 draws the Monte Carlo standard errors are 0.007 in the mean
and 0.5 % in the standard deviation.)
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from typing import cast

import torch

from lightning_dvi.moments import attention as A

__all__ = ["AttentionCell", "SkipCell", "attention_cell", "main", "rule_cost", "skip_cell"]


@dataclass(frozen=True)
class AttentionCell:
    """One rule on one grid cell (errors averaged over seeds)."""

    rule: str
    storage: str
    weight_std: float
    input_var: float
    mean_error: float
    max_mean_error: float
    std_error: float
    max_std_error: float


def _layer(width: int, std: float, gen: torch.Generator) -> A.ProjectionMoments:
    dt = torch.float64
    w = torch.randn(width, width, generator=gen, dtype=dt) / math.sqrt(width)
    b = 0.1 * torch.randn(width, generator=gen, dtype=dt)
    return A.ProjectionMoments(w, torch.full_like(w, std**2), b, torch.full_like(b, std**2))


def attention_cell(
    weight_std: float,
    input_var: float,
    rules: tuple[str, ...] = A.ATTENTION_RULES,
    *,
    draws: int = 20_000,
    seeds: int = 3,
    batch: int = 4,
    tokens: int = 6,
    width: int = 8,
    heads: int = 2,
    causal: bool = True,
    storage: str = "diag",
) -> list[AttentionCell]:
    """The errors of each rule on one cell of the grid (module docstring).

    ``storage``: the input as per-unit variances (``"diag"``) or per-token covariances
    (``"full"``, the same diagonal), which selects the moments' storage.
    """
    sums: dict[str, list[float]] = {r: [0.0, 0.0, 0.0, 0.0] for r in rules}
    for seed in range(seeds):
        gen = torch.Generator().manual_seed(seed)
        projections = [_layer(width, weight_std, gen) for _ in range(4)]
        mean = torch.randn(batch, tokens, width, generator=gen, dtype=torch.float64)
        var = torch.full_like(mean, input_var)
        total = torch.zeros_like(mean)
        outer = torch.zeros_like(mean)
        done = 0
        while done < draws:  # chunks keep the memory small
            s = min(2_000, draws - done)
            x = mean + var.sqrt() * torch.randn(s, *mean.shape, generator=gen, dtype=mean.dtype)
            weights = []
            for p in projections:
                assert p.w_var is not None and p.b_loc is not None and p.b_var is not None
                eps = torch.randn(s, *p.w_loc.shape, generator=gen, dtype=mean.dtype)
                b_eps = torch.randn(s, *p.b_loc.shape, generator=gen, dtype=mean.dtype)
                weights.append((p.w_loc + p.w_var.sqrt() * eps, p.b_loc + p.b_var.sqrt() * b_eps))
            y = A.attention_sample(x, *weights, heads=heads, causal=causal)
            total, outer, done = total + y.sum(0), outer + (y * y).sum(0), done + s
        mc_mean = total / draws
        mc_std = ((outer - draws * mc_mean**2) / (draws - 1)).clamp_min(1e-300).sqrt()
        for rule in rules:
            second = var if storage == "diag" else torch.diag_embed(var)
            got_mean, got_var = A.self_attention_moments(
                mean,
                second,
                *projections,
                heads=heads,
                rule=cast(A.AttentionRule, rule),
                causal=causal,
            )
            if storage == "full":
                got_var = got_var.diagonal(0, -2, -1)
            mean_err = (got_mean - mc_mean).abs() / mc_std
            std_err = (got_var.sqrt() / mc_std - 1).abs()
            acc = sums[rule]
            acc[0] += mean_err.mean().item()
            acc[1] += mean_err.max().item()
            acc[2] += std_err.mean().item()
            acc[3] += std_err.max().item()
    return [
        AttentionCell(rule, storage, weight_std, input_var, *(v / seeds for v in sums[rule]))
        for rule in rules
    ]


@dataclass(frozen=True)
class SkipCell:
    """Both skip rules on one cell: std relative errors ``(mean, max)`` against Monte Carlo."""

    scale_fraction: float
    input_var: float
    norm_first: bool
    errors: dict[str, tuple[float, float]]
    """``{"<where> <rule>": (mean, max)}``, ``where`` in attention/mlp/layer, averaged over seeds."""


def skip_cell(
    scale_fraction: float,
    input_var: float,
    norm_first: bool = True,
    *,
    draws: int = 20_000,
    seeds: int = 2,
    batch: int = 4,
    tokens: int = 6,
) -> SkipCell:
    r"""The skip rules (:mod:`lightning_dvi.moments.skip`) of one encoder layer against Monte Carlo.

    A ``torch.nn.TransformerEncoderLayer(8, 2, 16, activation="gelu")`` (LayerNorm gains and
    biases moved off 1 and 0 by :math:`\mathcal N(0, 0.3^2)`), converted in float64 with
    posterior standard deviations ``scale_fraction`` :math:`\times |w|` and SUQ's attention
    rule, the cheap rule set (first-order LayerNorm, closed GELU); tokens with standard-normal
    means and variance ``input_var``. For the attention skip (its input the tokens), the MLP
    skip (its input the carried rule's output of the attention skip) and the whole layer,
    each rule's ``diag`` standard deviations against ``draws`` Monte Carlo draws of inputs and
    whole weights: the relative error :math:`|\sigma/\hat\sigma - 1|`, mean and largest over
    the ``batch x tokens x 8`` outputs, averaged over ``seeds`` layers.
    """
    from torch import nn

    from lightning_dvi.gaussian import Gaussian
    from lightning_dvi.moments.skip import SKIP_RULES
    from lightning_dvi.nn import Residual, TransformerEncoderLayer, from_torch
    from lightning_dvi.nn.attention import _independent_skip
    from lightning_dvi.nn.posthoc import set_rules
    from lightning_dvi.propagation import DIAG, propagation

    sums: dict[str, list[float]] = {}
    sample = propagation("sample", num_samples=draws)
    for seed in range(seeds):
        torch.manual_seed(seed)
        model = nn.TransformerEncoderLayer(
            8, 2, 16, dropout=0.0, activation="gelu", batch_first=True, norm_first=norm_first
        )
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.startswith("norm"):
                    p.add_(0.3 * torch.randn_like(p))
        converted = from_torch(model.double().eval(), scale_fraction=scale_fraction)
        set_rules(
            converted, attention_rule="mean", layer_norm_route="first_order", gelu_rule="closed"
        )
        layer = next(m for m in converted.modules() if isinstance(m, TransformerEncoderLayer))
        gen = torch.Generator().manual_seed(100 + seed)
        mean = torch.randn(batch, tokens, 8, generator=gen, dtype=torch.float64)
        x = Gaussian(mean, var=torch.full_like(mean, input_var))
        skips = [m for m in layer if isinstance(m, Residual)]  # attention skip, MLP skip
        attention, mlp = skips[0], skips[1]
        with torch.no_grad():
            h = attention.propagate(x, DIAG)
            if not norm_first:
                h = layer[1].propagate(h, DIAG)
            assert isinstance(h, Gaussian)
            cases = {"attention": (attention, x), "mlp": (mlp, h)}
            for where, (block, inp) in cases.items():
                xs = inp.mean + inp.var.sqrt() * torch.randn(
                    draws, *inp.mean.shape, generator=gen, dtype=torch.float64
                )
                torch.manual_seed(1000 + seed)
                branch = block.branch.propagate(xs, sample)
                assert isinstance(branch, torch.Tensor)
                mc = (xs + branch).std(0)
                carried = block.propagate(inp, DIAG)
                assert isinstance(carried, Gaussian)
                got = {"carried": carried, "independent": _independent_skip(block, inp, DIAG)}
                for rule, g in got.items():
                    rel = (g.var.sqrt() / mc - 1).abs()
                    acc = sums.setdefault(f"{where} {rule}", [0.0, 0.0])
                    acc[0] += rel.mean().item()
                    acc[1] += rel.max().item()
            xs = mean + input_var**0.5 * torch.randn(
                draws, *mean.shape, generator=gen, dtype=torch.float64
            )
            torch.manual_seed(2000 + seed)
            whole = layer.propagate(xs, sample)
            assert isinstance(whole, torch.Tensor)
            mc = whole.std(0)
            for rule in SKIP_RULES:
                layer.skip_rule = rule
                out = layer.propagate(x, DIAG)
                assert isinstance(out, Gaussian)
                rel = (out.var.sqrt() / mc - 1).abs()
                acc = sums.setdefault(f"layer {rule}", [0.0, 0.0])
                acc[0] += rel.mean().item()
                acc[1] += rel.max().item()
    errors = {k: (v[0] / seeds, v[1] / seeds) for k, v in sums.items()}
    return SkipCell(scale_fraction, input_var, norm_first, errors)


def rule_cost(
    batch: int,
    tokens: int,
    width: int,
    heads: int,
    rules: tuple[str, ...] = A.ATTENTION_RULES,
    *,
    weight_std: float = 0.1,
    input_var: float = 0.01,
    reps: int = 5,
) -> dict[str, float]:
    """CPU seconds (``time.process_time``) per ``diag`` forward of each rule, float32, causal.

    The layer of :func:`attention_cell` at the given size, on tokens with variance
    ``input_var`` (``0``: deterministic tokens); the median of ``reps`` timed calls after one
    warm-up, on however many threads torch has (``main`` sets one).
    """
    gen = torch.Generator().manual_seed(0)

    def single(p: A.ProjectionMoments) -> A.ProjectionMoments:
        assert p.w_var is not None and p.b_loc is not None and p.b_var is not None
        return A.ProjectionMoments(
            p.w_loc.float(), p.w_var.float(), p.b_loc.float(), p.b_var.float()
        )

    projections = [single(_layer(width, weight_std, gen)) for _ in range(4)]
    mean = torch.randn(batch, tokens, width, generator=gen)
    second = None if input_var == 0 else torch.full_like(mean, input_var)
    out: dict[str, float] = {}
    for rule in rules:
        times = []
        for _ in range(reps + 1):
            start = time.process_time()
            A.self_attention_moments(
                mean, second, *projections, heads=heads,
                rule=cast(A.AttentionRule, rule), causal=True,
            )  # fmt: skip
            times.append(time.process_time() - start)
        out[rule] = sorted(times[1:])[reps // 2]
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the grid as a markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=20_000)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--weight-std", type=float, nargs="+", default=[0.0, 0.02, 0.05, 0.1, 0.2])
    parser.add_argument("--input-var", type=float, nargs="+", default=[0.0, 0.01, 0.1, 1.0])
    parser.add_argument("--storage", nargs="+", default=["diag", "full"], choices=["diag", "full"])
    parser.add_argument(
        "--cost", type=int, nargs=4, action="append", metavar=("B", "T", "D", "H"),
        help="print each rule's CPU time per diag forward at this size instead (repeatable)",
    )  # fmt: skip
    parser.add_argument(
        "--skip", action="store_true",
        help="print the skip rules' table instead (--weight-std as posterior std / |w|)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.skip:
        wheres = ("attention", "mlp", "layer")
        head = " | ".join(f"{w} {r}" for w in wheres for r in ("carried", "independent"))
        print(f"| std / abs(w) | input var | norm_first | {head} |")
        print("|---|---|---|" + "---|" * 6)
        for std in args.weight_std:
            for var in args.input_var:
                for norm_first in (True, False):
                    cell = skip_cell(std, var, norm_first, draws=args.draws, seeds=args.seeds)
                    cells = " | ".join(
                        "{:.3f} / {:.3f}".format(*cell.errors[f"{w} {r}"])
                        for w in wheres
                        for r in ("carried", "independent")
                    )
                    print(f"| {std:g} | {var:g} | {norm_first} | {cells} |", flush=True)
        return
    if args.cost:
        print("| B, T, D, H | input var | " + " | ".join(A.ATTENTION_RULES) + " |")
        print("|---|---|" + "---|" * len(A.ATTENTION_RULES))
        for size in args.cost:
            for var in args.input_var:
                cost = rule_cost(*size, input_var=var)
                cells = " | ".join(f"{1e3 * cost[r]:.1f} ms" for r in A.ATTENTION_RULES)
                print(f"| {', '.join(map(str, size))} | {var:g} | {cells} |")
        return
    print(
        "| weight std | input var | rule | storage | mean err (mean / max) "
        "| std rel err (mean / max) |"
    )
    print("|---|---|---|---|---|---|")
    for std in args.weight_std:
        for var in args.input_var:
            if std == 0 and var == 0:
                continue
            for storage in args.storage:
                for c in attention_cell(
                    std, var, draws=args.draws, seeds=args.seeds, storage=storage
                ):
                    print(
                        f"| {std:g} | {var:g} | {c.rule} | {storage} "
                        f"| {c.mean_error:.3f} / {c.max_mean_error:.3f} "
                        f"| {c.std_error:.3f} / {c.max_std_error:.3f} |"
                    )


if __name__ == "__main__":
    main()
