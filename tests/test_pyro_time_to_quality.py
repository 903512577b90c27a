"""recipes/pyro_time_to_quality.py: the documented L-BFGS loop and the recipe's report (issue 39)."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import load_recipe

from lightning_dvi.pyro import DeterministicELBO, DeterministicGuide

pytestmark = pytest.mark.usefixtures("pyro_state")


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("pyro_time_to_quality")  # it puts recipes/ on sys.path for its sibling


def test_lbfgs_loop_lowers_the_deterministic_loss_and_moves_every_guide_parameter(recipe):
    x, y, _, _ = recipe.load("cancer", 0)
    x, y = x[:120], y[:120]
    model = recipe.Classifier(x.shape[1], 2, "categorical", hidden=8)
    guide = DeterministicGuide(model)
    elbo = DeterministicELBO()
    before = elbo.loss(model, guide, x, y)
    start = {name: p.detach().clone() for name, p in guide.named_parameters()}
    run = recipe.lbfgs_loop(model, guide, x, y)
    run(5)
    middle = elbo.loss(model, guide, x, y)
    run(5)
    after = elbo.loss(model, guide, x, y)
    assert after < middle < before  # a line search never accepts a step that raises the loss
    assert len(start) == 8  # loc and scale of four weight sites
    for name, p in guide.named_parameters():
        assert not torch.equal(p.detach(), start[name]), name
    # the loop trains the guide's own parameters: the posterior medians moved with them
    median = guide.median(x)["fc1.weight"]
    assert torch.equal(median, guide.locs.fc1.weight.detach())
    assert not torch.equal(median, start["locs.fc1.weight_unconstrained"])


def test_recipe_reports_when_each_run_reaches_the_reference_nll(recipe, capsys):
    results = recipe.main(
        ["--data", "cancer", "--steps", "30", "--rounds", "2", "--lbfgs-iterations", "10",
         "--adam-steps", "50", "--adam-lr", "0.05", "--predictive", "20"]
    )  # fmt: skip
    out = capsys.readouterr().out
    target = results["autonormal"]["nll"]
    assert math.isfinite(target) and "(the target)" in out
    for key, iterations in (("lbfgs", (5, 10)), ("adam", (25, 50))):
        run = results[key]
        rows = [run["last"]] if run["reached"] is None else [run["reached"], run["last"]]
        assert run["last"][0] == iterations[-1]
        assert all(math.isfinite(r[3]) and r[1] > 0 for r in rows)
        if run["reached"] is not None:  # the first evaluation at or below the target
            assert run["reached"][3] <= target and run["reached"][0] in iterations
    assert out.count("| lbfgs |") == 1 and out.count("| adam |") == 1


def test_step_cost_splits_the_deterministic_step_into_its_parts(recipe):
    parts = recipe.main(["--data", "cancer", "--step-cost", "2"])
    losses = parts.pop("loss (parts)"), parts.pop("loss (ELBO)")
    assert set(parts) == {
        "dvi step",
        "autonormal step",
        "loss forward",
        "loss forward + backward",
        "guide trace (parameters collected)",
        "site-shape check (first call only)",
        "layer 1 moments",
        "ReLU moments",
        "layer 2 moments, [N, K, K] head covariance",
        "objective (tight) forward",  # the Pyro Categorical site's default objective
        "objective (tight) forward + backward",
        "KL of the weight sites",
        "arithmetic (sum of the parts above)",
        "Pyro handling (loss f+b less arithmetic)",
        "SVI bookkeeping (step less loss f+b)",
    }
    measured = {k: v for k, v in parts.items() if "less" not in k}  # derived ones may be < 0
    assert all(value > 0 for value in measured.values())
    # the timed parts are the whole loss: their sum reproduces the ELBO's value
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_parity_trajectory_deterministic_guide_does_not_depend_on_the_evaluations():
    module = load_recipe("pyro_parity_trajectory")
    base = ["--steps", "20", "--predictive", "10"]
    often = module.main([*base, "--every", "5"])
    once = module.main([*base, "--every", "20"])
    assert [r["step"] for r in often] == [5, 10, 15, 20] and [r["step"] for r in once] == [20]
    assert often[-1]["loss"] == once[-1]["loss"]  # no random numbers in its training
    assert often[0]["loss"] > often[-1]["loss"]
    small = module.main(
        [*base, "--every", "20", "--init-scale", "0.1", "--init-means", "normal:0.1"]
    )
    assert small[-1]["loss"] != once[-1]["loss"]  # the options reach the guide


def test_step_ab_same_shape_rule_leaves_every_loss_unchanged():
    # The A/B behind docs/pyro.md's step-cost table: the deterministic guide with and without
    # the rule for shape ops that move no element reports the same loss at every step.
    module = load_recipe("pyro_step_ab")
    summary = module.main(
        ["--data", "cancer", "--warmup", "3", "--rounds", "4", "--backend", "eager"]
    )
    assert summary["identical_losses"] is True
    assert set(summary) == {
        "identical_losses", "autonormal", "dvi", "dvi_before", "dvi_compiled", "compile_cpu_s",
        "compiled_max_rel_diff",
    }  # fmt: skip
    assert summary["compiled_max_rel_diff"] < 1e-5  # the compiled step: float32 rounding
    assert summary["autonormal"]["x_autonormal"] == pytest.approx(1.0)
    from lightning_dvi.pyro import moment_rules

    assert moment_rules._IDENTITY_IF_SAME_SHAPE  # the recipe put the rule back
