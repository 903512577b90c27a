r"""Lower bounds on E log softmax(a)_y against Monte Carlo on issue 41's grid, with their cost.

Logits :math:`a\sim\mathcal N(\mu, C)`, 10 classes, float64; per logit variance v in 1e-3 ...
1e2, 64 rows with means :math:`2\,\mathcal N(0, I)`, correlated covariances of trace
:math:`Kv` and a random label (``lightning_dvi_benchmarks.softmax_grid.objective_grid``). The
oracle is ``--draws`` Monte Carlo draws per row. For each method: the mean gap Monte Carlo -
method per v (positive = pessimistic), the largest gap over the grid, the rows above Monte
Carlo by more than 3 of its standard errors (optimistic: a bound must have none), and the time
per datum of value and gradient (float64, one thread, on the grid's rows repeated to
``--time-rows``; median over ``--repeats`` rounds of the fastest of 3 calls) and its ratio to
``Categorical(method="bound")``, timed alternately with it.

Usage::

    python recipes/categorical_tight_bound.py [--draws 200000] [--seed 0] [--rows 64]
        [--repeats 7] [--time-rows 1024]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from lightning_dvi.likelihoods import functional as F
from lightning_dvi_benchmarks import softmax_grid as G

Method = Callable[[Tensor, Tensor, Tensor], Tensor]

METHODS: dict[str, Method] = {
    "tight (library default)": F.categorical_tight_expected_log_prob,
    "bound (earlier default)": F.categorical_bound_expected_log_prob,
    "Jensen, softmax reference, t = 1": partial(
        G.tempered_jensen_expected_log_prob, reference="softmax_t1"
    ),
    "tempered Jensen, softmax reference": G.tempered_jensen_expected_log_prob,
    "tempered Jensen on differences a_k - a_y": partial(
        G.tempered_jensen_expected_log_prob, reference="label"
    ),
    "tempered Jensen, plain logits": partial(G.tempered_jensen_expected_log_prob, reference="zero"),
    "Bouchard / Knowles-Minka, mean reference": G.bouchard_expected_log_prob,
    "Bouchard / Knowles-Minka, plain logits": partial(
        G.bouchard_expected_log_prob, reference="zero"
    ),
    "one-vs-each (Titsias)": G.one_vs_each_expected_log_prob,
    "Boehning quadratic": G.boehning_expected_log_prob,
    "delta (B.4; not a bound)": F.categorical_delta_expected_log_prob,
}


def monte_carlo(
    grid: dict[float, tuple[Tensor, Tensor, Tensor]], draws: int, gen: torch.Generator
) -> dict[float, tuple[Tensor, Tensor]]:
    """``{v: (mean, standard error)}`` of ``log softmax(a)_y`` per row, ``draws`` draws each."""
    out = {}
    for v, (mean, cov, y) in grid.items():
        mc, se = [], []
        for i in range(mean.shape[0]):
            ls = torch.log_softmax(G.gaussian_draws(mean[i], cov[i], draws, gen), -1)[:, y[i]]
            mc.append(ls.mean())
            se.append(ls.std() / draws**0.5)
        out[v] = (torch.stack(mc), torch.stack(se))
    return out


def _seconds(fn: Method, mean: Tensor, cov: Tensor, y: Tensor, calls: int = 3) -> float:
    """Seconds of one value-and-gradient call, the fastest of ``calls`` back to back."""
    best = float("inf")
    for _ in range(calls):
        m, c = mean.clone().requires_grad_(), cov.clone().requires_grad_()
        start = time.perf_counter()
        fn(m, c, y).sum().backward()
        best = min(best, time.perf_counter() - start)
    return best


def time_per_datum(
    fn: Method, mean: Tensor, cov: Tensor, y: Tensor, repeats: int
) -> tuple[float, float]:
    """Seconds per datum of the value and its gradient, and the ratio to ``bound``.

    Each is the median over ``repeats`` rounds of the fastest of 3 calls; the method and
    ``bound`` alternate within a round (after a warm-up), so that load on the machine affects
    both alike. One thread.
    """
    base = F.categorical_bound_expected_log_prob
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _seconds(fn, mean, cov, y, 1), _seconds(base, mean, cov, y, 1)
        own, other = [], []
        for _ in range(repeats):
            own.append(_seconds(fn, mean, cov, y))
            other.append(_seconds(base, mean, cov, y))
    finally:
        torch.set_num_threads(threads)
    own_s, base_s = sorted(own)[repeats // 2], sorted(other)[repeats // 2]
    return own_s / mean.shape[0], own_s / base_s


def table(
    draws: int, seed: int, rows: int, repeats: int, time_rows: int = 1024
) -> list[dict[str, object]]:
    """One dict per method: ``name``, ``mean_gap`` per v, ``max_gap``, ``optimistic``, ``time``."""
    gen = torch.Generator().manual_seed(seed)
    grid = G.objective_grid(gen, rows=rows)
    mc = monte_carlo(grid, draws, gen)
    # timing batch: every grid row, repeated to at least time_rows rows
    tile = -(-time_rows // (rows * len(grid)))
    mean = torch.cat([g[0] for g in grid.values()]).repeat(tile, 1)
    cov = torch.cat([g[1] for g in grid.values()]).repeat(tile, 1, 1)
    y = torch.cat([g[2] for g in grid.values()]).repeat(tile)
    out = []
    for name, fn in METHODS.items():
        gaps, optimistic, worst = {}, 0, 0.0
        with torch.no_grad():
            for v, (m, c, labels) in grid.items():
                ref, se = mc[v]
                gap = ref - fn(m, c, labels)
                gaps[v] = float(gap.mean())
                worst = max(worst, float(gap.max()))
                optimistic += int((gap < -3 * se).sum())
        seconds, ratio = time_per_datum(fn, mean, cov, y, repeats)
        out.append(
            {
                "name": name,
                "mean_gap": gaps,
                "max_gap": worst,
                "optimistic": optimistic,
                "us_per_datum": 1e6 * seconds,
                "time_vs_bound": ratio,
            }
        )
    return out


def main(argv: list[str] | None = None) -> None:
    """Print the table (markdown)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--time-rows", type=int, default=1024, help="rows of the timing batch")
    args = parser.parse_args(argv)
    rows = table(args.draws, args.seed, args.rows, args.repeats, args.time_rows)
    scales = list(rows[0]["mean_gap"])  # type: ignore[call-overload]
    print(
        f"{args.rows} rows per logit variance v, K = 10, {args.draws} Monte Carlo draws each; "
        "mean gap MC - method (nats); optimistic: rows above MC by > 3 SE; "
        "time: value + gradient per datum, relative to 'bound'"
    )
    head = " | ".join(f"v={v:g}" for v in scales)
    print(f"| method | {head} | max gap | optimistic rows | us/datum | time vs bound |")
    print("|---" * (len(scales) + 5) + "|")
    for r in rows:
        gaps = " | ".join(f"{g:.4f}" for g in r["mean_gap"].values())  # type: ignore[attr-defined]
        print(
            f"| {r['name']} | {gaps} | {r['max_gap']:.3g} | {r['optimistic']} | "
            f"{r['us_per_datum']:.1f} | {r['time_vs_bound']:.2f}x |"
        )


if __name__ == "__main__":
    main()
