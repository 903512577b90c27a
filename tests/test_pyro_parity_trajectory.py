"""recipes/pyro_parity_trajectory.py: one guide's test NLL along training, by initial draw."""

from __future__ import annotations

import json

import pytest
from helpers import load_recipe

pytestmark = pytest.mark.usefixtures("pyro_state")


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("pyro_parity_trajectory")  # it puts recipes/ on sys.path for its sibling


def test_init_seed_picks_the_draw_and_the_json_line_records_the_end(recipe, tmp_path):
    out = tmp_path / "rows.jsonl"
    base = ["--steps", "6", "--every", "3", "--predictive", "10", "--json", str(out)]
    a = recipe.main([*base, "--init-seed", "5"])
    b = recipe.main([*base, "--init-seed", "5"])
    c = recipe.main([*base, "--init-seed", "6"])
    # the deterministic guide draws only its initial means: one draw, one trajectory
    assert [r["loss"] for r in a] == [r["loss"] for r in b]
    assert [r["loss"] for r in a] != [r["loss"] for r in c]
    assert [r["step"] for r in a] == [3, 6]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["init_seed"] for line in lines] == [5, 5, 6]
    assert lines[0]["final_elbo"] == pytest.approx(a[-1]["final_elbo"])
    assert lines[0]["nll"] == a[-1]["nll"] and lines[0]["data"] == "cancer"
    # the final ELBO is the deterministic loss after the last step: above the start
    assert a[-1]["final_elbo"] > -a[0]["loss"]


def test_swap_draw_scales_and_worst_points(recipe):
    base = ["--steps", "4", "--every", "2", "--predictive", "10", "--init-seed", "5"]
    plain = recipe.main(base)
    swap = recipe.main([*base, "--swap-draw", "--worst", "2"])
    # the swap recipe's draw comes after a second model's parameters: another start
    assert [r["loss"] for r in plain] != [r["loss"] for r in swap]
    last = swap[-1]
    assert set(last["scales"]) == {"fc1.weight", "fc2.weight"}
    # the default init_scale (0.05) moved by at most 4 Adam(1e-2) steps, in softplus space
    assert all(0.03 < mean < 0.07 and big > 0 for mean, big in last["scales"].values())
    assert len(last["worst"]) == 2 and last["worst"][0] >= last["worst"][1] >= 0
    # the worst points' share of the summed test NLL: their sum over 126 points' NLL sum
    assert last["worst_share"] == pytest.approx(sum(last["worst"]) / (126 * last["nll"]), rel=1e-4)


@pytest.mark.parametrize("likelihood", ["bernoulli", "categorical"])
def test_vectorised_predictive_is_the_model_runs_mixture(recipe, likelihood):
    import pyro
    import torch

    from lightning_dvi.pyro import DeterministicGuide

    x, y, x_te, _ = recipe.load("cancer", 0)
    pyro.clear_param_store()
    pyro.set_rng_seed(0)
    model = recipe.Classifier(x.shape[1], 1 if likelihood == "bernoulli" else 2, likelihood)
    guide = DeterministicGuide(model, init_scale=1e-7)  # near-point posterior: no MC noise
    guide(x, y.float() if likelihood == "bernoulli" else y)
    expected = recipe.class_probs(model, guide, x_te, 3)  # Pyro's Predictive, one run per draw
    got = recipe.vectorised_probs(guide, x_te, likelihood, 1500)  # two chunks
    assert got.shape == expected.shape == (x_te.shape[0], 2)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert not torch.allclose(got[:, 1], got[:1, 1].expand(x_te.shape[0]))  # depends on x


def test_repeated_and_many_draw_evaluations(recipe):
    evaluations = ["--predictive", "5", "--repeat-evals", "3", "--final-draws", "200"]
    rows = recipe.main(["--steps", "2", "--every", "2", *evaluations])
    last = rows[-1]
    assert len(last["nll_repeats"]) == 3 and len(set(last["nll_repeats"])) == 3  # 5-draw noise
    assert 0 < last["nll_final_draws"] < 5
