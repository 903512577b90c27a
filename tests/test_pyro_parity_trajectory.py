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
