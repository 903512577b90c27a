"""recipes/pyro_elbo_sites.py: the deterministic ELBO of the tutorial classifier, site by site.

At the parameters of both trained guides (AutoNormal's copied into a DeterministicGuide), every
site's deterministic term must match a Monte Carlo of the same parameters: the analytic KL of
each weight site against ``log p(w) - log q(w)`` over weight draws, the expected
log-likelihood against ``log p(y | f(w))`` over weight draws and over the moment pass's own
Gaussian logits. A wrong sign, a missing or doubled KL term, a likelihood scale or a dropped
logit covariance would each move one site's term by many standard errors.
"""

from __future__ import annotations

import pytest
from helpers import load_recipe

pytestmark = pytest.mark.usefixtures("pyro_state")


@pytest.fixture(scope="module")
def recipe():
    return load_recipe("pyro_elbo_sites")  # it puts recipes/ on sys.path for its sibling


@pytest.mark.parametrize("likelihood", ["bernoulli", "categorical"])
def test_every_site_matches_monte_carlo_at_both_guides_parameters(recipe, likelihood):
    results = recipe.main(
        ["--data", "cancer", "--likelihood", likelihood, "--steps", "40", "--draws", "300",
         "--logit-draws", "400", "--predictive", "20", "--continue-steps", "4", "--every", "2"]
    )  # fmt: skip
    for kind in ("dvi", "autonormal"):
        rows = results[kind]["sites"]
        assert set(rows) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "obs", "ELBO"}
        for name, r in rows.items():
            # one hidden layer: diag mode keeps every covariance the head needs, so the two
            # modes give the same objective
            assert r["full"] == pytest.approx(r["diag"], rel=1e-5, abs=1e-3), (kind, name)
            assert abs(r["diag"] - r["mc"]) <= 4 * r["mc_se"] + 0.5, (kind, name, r)
        obs = rows["obs"]
        assert abs(obs["diag"] - obs["logit_mc"]) <= 4 * obs["logit_mc_se"] + 0.2, (kind, obs)
        assert rows["ELBO"]["diag"] == pytest.approx(
            sum(v["diag"] for k, v in rows.items() if k != "ELBO")
        )
        assert 0 < results[kind]["nll"] < 1
    continued = results["continued"]
    assert [r["step"] for r in continued] == [0, 2, 4]
    # the continuation starts at AutoNormal's solution and climbs the deterministic ELBO
    assert continued[0]["elbo"] == pytest.approx(results["autonormal"]["sites"]["ELBO"]["diag"])
    assert continued[-1]["elbo"] > continued[0]["elbo"]
