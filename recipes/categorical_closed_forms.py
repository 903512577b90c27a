r"""Closed-form softmax integrals against a Monte Carlo oracle over a grid (issue 17).

For logits :math:`a\sim\mathcal N(\mu, C)` compares, against ``--draws`` Monte Carlo draws
(float64), the predictive :math:`\mathbb E\operatorname{softmax}(a)` (total-variation
distance) and the expected log-likelihood :math:`\mathbb E\log\operatorname{softmax}(a)_y`
for every label (largest absolute error) over the grid

* K = 2, 3, 10 classes;
* logit variance scale v = 1e-2, 1e-1, 1, 10, 100;
* mean gap g = 0, 0.5, 1, 2, 5, 10, 20: either one class at g above the others ("top") or
  means spread uniformly in [0, g] ("spread");
* covariance: isotropic vI, random diag (v times U(0.2, 1.8)), random correlated full
  (v A A^T normalised to mean diagonal v).

Candidates: the second-order delta method (appendix B.4/B.5), the library's predictive
(``lightning_dvi.likelihoods.predictive.categorical_predictive``, issue 26: the conditional
mean-field form mixed with the multinomial probit), its two parts alone, the pairwise
mean-field probit predictive (the library's before issue 26), the per-class probit
``softmax(mu / sqrt(1 + pi/8 C_kk))``, the Laplace bridge (Hobbhahn et al. 2022, diag only),
the plug-in ``log_softmax(mu)`` and the Clark smoothed-max expected log-likelihood.

``--table objective`` (issue 23) measures the expected log-likelihoods as *training
objectives*: the signed error ``closed form - Monte Carlo`` (positive = optimistic, which an
optimiser can exploit) over logit variance scales 1e-3 ... 1e3, in nats and in units of the
oracle's own standard error, for the certified bounds (``Categorical(method="tight")``, the
default, and the earlier ``method="bound"``), Clark, the delta method and plain Jensen. Issue
41's comparison of lower bounds, with their cost: ``recipes/categorical_tight_bound.py``.
Usage::

    python recipes/categorical_closed_forms.py [--draws 200000] [--seed 0] [--table all]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
from torch import Tensor

from lightning_dvi.likelihoods import functional as F
from lightning_dvi.likelihoods import predictive as P
from lightning_dvi_benchmarks import softmax_grid as G

SCALES, CLASSES = G.SCALES, G.CLASSES
OBJECTIVE_SCALES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0, 1e3)
PREDICTIVE_SCALES = OBJECTIVE_SCALES  # issue 26: the predictive from 1e-3 to 1e3


PREDICTIVES = {
    "delta (B.5)": F.categorical_delta_predictive,
    "library (conditional mean-field + multinomial probit)": P.categorical_predictive,
    "conditional mean-field": P.categorical_conditional_mean_field,
    "multinomial probit": P.categorical_multinomial_probit,
    "pairwise mean-field probit": F.categorical_mean_field_predictive,
    "per-class probit": G.probit_softmax,
    "Laplace bridge": G.laplace_bridge,
}


def _plug_in(mean: Tensor, cov: Tensor, y: Tensor) -> Tensor:
    return torch.log_softmax(mean, -1).gather(-1, y.unsqueeze(-1)).squeeze(-1)


EXPECTED_LOG_LIKS = {
    "delta (B.4)": F.categorical_delta_expected_log_prob,
    "Clark smoothed max": F.categorical_clark_expected_log_prob,
    "plug-in": _plug_in,
}


OBJECTIVES = {
    "tight (library default)": F.categorical_tight_expected_log_prob,
    "bound (earlier default)": F.categorical_bound_expected_log_prob,
    "Clark smoothed max": F.categorical_clark_expected_log_prob,
    "delta (B.4)": F.categorical_delta_expected_log_prob,
    "Jensen mu_y - lse(mu + v/2)": G.jensen_expected_log_prob,
}


def objective_table(draws: int, seed: int) -> None:
    """Signed errors of the expected log-likelihoods against Monte Carlo (issue 23)."""
    gen = torch.Generator().manual_seed(seed)
    rows: dict[str, list[tuple[int, float, float, float, float]]] = defaultdict(list)
    for k, v, _gap, kind, _layout, mean, cov in G.grid(gen, OBJECTIVE_SCALES):
        log_sm = torch.log_softmax(G.gaussian_draws(mean, cov, draws, gen), -1)
        mc, se = log_sm.mean(0), log_sm.std(0) / draws**0.5
        c = cov if kind == "full" else cov.diagonal()
        labels = torch.arange(k)
        means, covs = mean.expand(k, k), c.expand(k, *c.shape)
        for name, fn in OBJECTIVES.items():
            err = fn(means, covs, labels) - mc
            for e, s, m in zip(err.tolist(), se.tolist(), mc.tolist(), strict=True):
                rows[name].append((k, v, e, e / s, e / abs(m)))
    n = len(rows["tight (library default)"])
    ses = [r[2] / r[3] for r in rows["Clark smoothed max"] if r[3] != 0]
    print(
        f"\n{n} (grid point, label) pairs, {draws} Monte Carlo draws each; oracle standard error "
        f"median {torch.tensor(ses).median():.2g}, max {max(ses):.2g} nats"
    )
    print("\nSigned error closed form - Monte Carlo, nats (positive = optimistic)")
    head = " | ".join(f"v={v:g}" for v in OBJECTIVE_SCALES)
    print(f"| method | max optimism | max z | {head} |")
    for name, rs in rows.items():
        most = [max(r[2] for r in rs if r[1] == v) for v in OBJECTIVE_SCALES]
        cells = " | ".join(f"{x:+.2g}" for x in most)
        print(f"| {name} | {max(r[2] for r in rs):+.3g} | {max(r[3] for r in rs):.3g} | {cells} |")
    print("\nPessimism Monte Carlo - closed form, nats (max per column; K = 2 / 3 / 10)")
    print(f"| method | K | {head} |")
    for name, rs in rows.items():
        for k in CLASSES:
            worst = [max(-r[2] for r in rs if r[1] == v and r[0] == k) for v in OBJECTIVE_SCALES]
            print(f"| {name} | {k} | " + " | ".join(f"{x:.2g}" for x in worst) + " |")


def predictive_tables(draws: int, seed: int) -> None:
    """Predictive TV (issue 26's grid) and expected log-likelihood |error| (issue 17's) tables."""
    tv: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    ll: dict[str, list[tuple[int, float, float]]] = defaultdict(list)
    gen = torch.Generator().manual_seed(seed)
    for k, v, _gap, kind, _layout, mean, cov in G.grid(gen, PREDICTIVE_SCALES):
        mc_probs = torch.softmax(G.gaussian_draws(mean, cov, draws, gen), -1).mean(0)
        c = cov if kind == "full" else cov.diagonal()
        for name, fn in PREDICTIVES.items():
            if name == "Laplace bridge" and kind == "full":
                continue
            tv[name].append((k, v, 0.5 * (fn(mean, c) - mc_probs).abs().sum().item()))
    gen = torch.Generator().manual_seed(seed)
    for k, v, _gap, kind, _layout, mean, cov in G.grid(gen):
        mc_ll = torch.log_softmax(G.gaussian_draws(mean, cov, draws, gen), -1).mean(0)
        c = cov if kind == "full" else cov.diagonal()
        labels = torch.arange(k)
        means, covs = mean.expand(k, k), c.expand(k, *c.shape)
        for name, fn in EXPECTED_LOG_LIKS.items():
            err = (fn(means, covs, labels) - mc_ll).abs().max().item()
            ll[name].append((k, v, err))

    def table(
        title: str, rows: dict[str, list[tuple[int, float, float]]], scales: tuple[float, ...]
    ) -> None:
        print(f"\n{title}")
        head = (
            " | ".join(f"v={v:g}" for v in scales) + " | " + " | ".join(f"K={k}" for k in CLASSES)
        )
        print(f"| method | max | mean | {head} |")
        for name, errs in rows.items():
            e = torch.tensor([r[2] for r in errs])
            by_v = [max(r[2] for r in errs if r[1] == v) for v in scales]
            by_k = [max(r[2] for r in errs if r[0] == k) for k in CLASSES]
            cells = " | ".join(f"{x:.3g}" for x in (*by_v, *by_k))
            print(f"| {name} | {e.max():.3g} | {e.mean():.3g} | {cells} |")

    print(
        f"{len(tv['delta (B.5)'])} (predictive) and {len(ll['plug-in'])} (expected "
        f"log-likelihood) grid points, {draws} Monte Carlo draws each"
    )
    table(
        "Predictive: total-variation distance to Monte Carlo (max per column)",
        tv,
        PREDICTIVE_SCALES,
    )
    table("Expected log-likelihood: max |error| over labels, nats (max per column)", ll, SCALES)


def main(argv: list[str] | None = None) -> None:
    """Run the comparisons and print the error tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--draws", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--table", choices=("predictive", "objective", "all"), default="all")
    args = parser.parse_args(argv)
    if args.table in ("predictive", "all"):
        predictive_tables(args.draws, args.seed)
    if args.table in ("objective", "all"):
        objective_table(args.draws, args.seed)


if __name__ == "__main__":
    main()
