"""The softmax grid and reference forms of recipes/categorical_closed_forms.py."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import torch

from lightning_dvi_benchmarks import softmax_grid as G


def test_grid_covers_every_cell_with_valid_covariances() -> None:
    cases = G.grid(torch.Generator().manual_seed(0), (0.1, 10.0))
    assert len(cases) == len(G.CLASSES) * 2 * len(G.GAPS) * len(G.KINDS) * 2
    for k, v, gap, kind, layout, mean, cov in cases:
        assert mean.shape == (k,) and cov.shape == (k, k) and mean.dtype == torch.float64
        if kind == "diag":  # v times U(0.2, 1.8)
            assert ((cov.diagonal() >= 0.2 * v) & (cov.diagonal() <= 1.8 * v)).all()
        else:
            torch.testing.assert_close(cov.diagonal().mean(), torch.tensor(v, dtype=torch.float64))
        assert torch.linalg.eigvalsh(cov).min() > -1e-9 * v
        assert math.isclose(float(mean.max() - mean.min()), gap, abs_tol=1e-12)
        if layout == "top":
            assert float(mean[0]) == gap and (mean[1:] == 0).all()
        if kind != "full":
            torch.testing.assert_close(cov, torch.diag(cov.diagonal()))


def test_reference_predictives_are_distributions_with_the_right_limits() -> None:
    mean = torch.tensor([2.0, 0.0, -1.0], dtype=torch.float64)
    tiny = torch.full((3,), 1e-12, dtype=torch.float64)
    # no logit variance: the per-class probit is the softmax
    torch.testing.assert_close(G.probit_softmax(mean, tiny), torch.softmax(mean, -1))
    for var in (0.1, 1.0, 100.0):
        for f in (G.probit_softmax, G.laplace_bridge):
            p = f(mean, torch.diag(torch.full((3,), var, dtype=torch.float64)))
            assert (p > 0).all()
            torch.testing.assert_close(p.sum(), torch.tensor(1.0, dtype=torch.float64))
    # symmetric logits: both are uniform
    zero = torch.zeros(4, dtype=torch.float64)
    for f in (G.probit_softmax, G.laplace_bridge):
        torch.testing.assert_close(
            f(zero, torch.ones(4, dtype=torch.float64)), torch.full((4,), 0.25, dtype=torch.float64)
        )


def test_draws_and_jensen_against_monte_carlo() -> None:
    gen = torch.Generator().manual_seed(1)
    _, _, _, _, _, mean, cov = G.grid(gen, (1.0,))[-1]  # K=10, full correlated covariance
    x = G.gaussian_draws(mean, cov, 200_000, gen)
    torch.testing.assert_close(x.mean(0), mean, atol=0.02, rtol=0)
    torch.testing.assert_close(torch.cov(x.T), cov, atol=0.03, rtol=0)
    y = torch.arange(mean.shape[-1])
    mc = torch.log_softmax(x, -1).mean(0)
    bound = G.jensen_expected_log_prob(mean.expand(len(y), -1), cov.expand(len(y), -1, -1), y)
    # a lower bound: never above the Monte Carlo value beyond its noise (here < 0.01 nats)
    assert (bound <= mc + 0.01).all()


def test_objective_grid_rows_and_candidate_bounds_below_monte_carlo() -> None:
    gen = torch.Generator().manual_seed(2)
    grid = G.objective_grid(gen, (0.1, 10.0), rows=3, classes=4)
    for v, (mean, cov, y) in grid.items():
        assert mean.shape == (3, 4) and cov.shape == (3, 4, 4) and y.shape == (3,)
        torch.testing.assert_close(
            cov.diagonal(dim1=-2, dim2=-1).sum(-1), torch.full((3,), 4 * v, dtype=torch.float64)
        )
        for i in range(3):
            ls = torch.log_softmax(G.gaussian_draws(mean[i], cov[i], 50_000, gen), -1)[:, y[i]]
            mc, se = ls.mean(), ls.std() / 50_000**0.5
            for fn in (
                G.boehning_expected_log_prob,
                G.tempered_jensen_expected_log_prob,
                G.bouchard_expected_log_prob,
                G.one_vs_each_expected_log_prob,
            ):
                assert fn(mean[i : i + 1], cov[i : i + 1], y[i : i + 1]) <= mc + 3 * se, fn


def test_tight_bound_recipe_runs_and_prints_every_method() -> None:
    # as a user runs it: a fresh process on the recipe file (tiny grid, few draws)
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run(
        [
            sys.executable,
            str(root / "recipes" / "categorical_tight_bound.py"),
            *("--draws", "2000", "--rows", "2", "--repeats", "1", "--time-rows", "32"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    lines = {
        r.split("|")[1].strip(): r.split("|")[2:-1]
        for r in run.stdout.splitlines()
        if r.startswith("| ")
    }
    for name in ("tight (library default)", "bound (earlier default)", "Boehning quadratic"):
        assert name in lines, run.stdout
    tight, bound = lines["tight (library default)"], lines["bound (earlier default)"]
    assert int(tight[-3]) == 0  # no optimistic row
    for col in (3, 4, 5):  # v = 1, 10, 100: at most half the earlier bound's mean gap
        assert float(tight[col]) <= 0.5 * float(bound[col])
