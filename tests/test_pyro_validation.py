"""lightning_dvi.pyro.validation: held-out predictive NLL and the best-snapshot checkpoint."""

from __future__ import annotations

import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from helpers import load_recipe
from pyro.infer import SVI, Trace_ELBO
from pyro.infer.autoguide import AutoNormal
from pyro.nn import PyroModule, PyroSample
from torch import nn

from lightning_dvi.pyro import (
    DeterministicELBO,
    DeterministicGuide,
    ValidationCheckpoint,
    predictive_log_density,
    predictive_nll,
)

pytestmark = pytest.mark.usefixtures("pyro_state")


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))
        self.b = nn.Parameter(torch.zeros(()))


def run_trajectory(scores: list[float], every: int, patience: int | None) -> tuple:
    """Step k sets the parameters to k; the score at the j-th evaluation is scores[j]."""
    holder = Holder()
    values = iter(scores)
    checkpoint = ValidationCheckpoint(
        lambda: next(values), every=every, patience=patience, params=holder
    )
    stopped = None
    for step in range(1, every * len(scores) + 1):
        with torch.no_grad():
            holder.w.fill_(float(step))
            holder.b.fill_(-float(step))
        if checkpoint.update(step):
            stopped = step
            break
    return holder, checkpoint, stopped


def test_restore_puts_back_exactly_the_best_evaluations_parameters():
    scores = [5.0, 3.0, 4.0, 2.0, 2.5, 6.0, 7.0]
    holder, checkpoint, stopped = run_trajectory(scores, every=3, patience=None)
    assert stopped is None
    assert [s for s, _ in checkpoint.history] == [3, 6, 9, 12, 15, 18, 21]
    assert checkpoint.best_step == 12 and checkpoint.best_score == 2.0
    w_live = holder.w  # the optimiser's reference
    assert holder.w[0].item() == 21.0
    assert checkpoint.restore() == 12
    assert holder.w is w_live  # copied in place
    assert torch.equal(holder.w, torch.full((3,), 12.0))
    assert holder.b.item() == -12.0


def test_patience_stops_after_that_many_evaluations_without_improvement():
    scores = [5.0, 3.0, 4.0, 2.0, 2.5, 2.0, 7.0, 1.0]  # a tie is not an improvement
    holder, checkpoint, stopped = run_trajectory(scores, every=2, patience=3)
    assert stopped == 14  # evaluations at 10, 12, 14 did not beat step 8's 2.0
    assert checkpoint.best_step == 8
    checkpoint.restore()
    assert holder.w[0].item() == 8.0
    # patience 4 would have reached step 16's 1.0
    _, longer, stopped = run_trajectory(scores, every=2, patience=4)
    assert stopped is None and longer.best_step == 16


def test_nan_never_best_and_restore_needs_an_evaluation():
    _, checkpoint, _ = run_trajectory([math.nan, math.nan], every=1, patience=None)
    with pytest.raises(RuntimeError, match="nothing to restore"):
        checkpoint.restore()
    _, checkpoint, _ = run_trajectory([math.nan, 1.0, math.nan], every=1, patience=None)
    assert checkpoint.best_step == 2
    with pytest.raises(ValueError, match="every"):
        ValidationCheckpoint(lambda: 0.0, every=0)
    with pytest.raises(ValueError, match="patience"):
        ValidationCheckpoint(lambda: 0.0, patience=0)


def test_default_keeps_the_global_param_store_in_place():
    p = pyro.param("p", torch.zeros(2))
    q = pyro.param("q", torch.ones(1), constraint=dist.constraints.positive)
    checkpoint = ValidationCheckpoint(lambda: pyro.param("p").detach().sum().item(), every=1)
    unconstrained = dict(pyro.get_param_store().named_parameters())
    for step, value in enumerate([3.0, -1.0, 2.0], start=1):
        with torch.no_grad():
            unconstrained["p"].fill_(value)
            unconstrained["q"].fill_(value)
        checkpoint.update(step)
    assert checkpoint.restore() == 2
    assert torch.equal(pyro.param("p"), torch.full((2,), -1.0))
    assert pyro.param("q").item() == pytest.approx(math.exp(-1.0))  # unconstrained kept
    assert dict(pyro.get_param_store().named_parameters())["p"] is unconstrained["p"]
    del p, q


class Linear(PyroModule):
    def __init__(self, d: int, sigma: float) -> None:
        super().__init__()
        self.fc = PyroModule[nn.Linear](d, 1)
        self.fc.weight = PyroSample(dist.Normal(0.0, 1.0).expand([1, d]).to_event(2))
        self.fc.bias = PyroSample(dist.Normal(0.0, 1.0).expand([1]).to_event(1))
        self.sigma = sigma

    def forward(self, x, y=None):
        mean = self.fc(x).squeeze(-1)
        with pyro.plate("data", x.shape[0]):
            return pyro.sample("obs", dist.Normal(mean, self.sigma), obs=y)


def test_predictive_nll_against_the_closed_form_predictive_of_a_linear_model():
    """Oracle: y_n ~ N(m.x_n + m_b, sum_j s_j^2 x_nj^2 + s_b^2 + sigma^2) under the guide."""
    torch.manual_seed(1)
    x, y = torch.randn(40, 3), torch.randn(40)
    model = Linear(3, sigma=0.5)
    guide = DeterministicGuide(model, init_scale=0.4)
    guide(x, y)
    (m_w, s_w), (m_b, s_b) = (guide._get_loc_and_scale(k) for k in ("fc.weight", "fc.bias"))
    with torch.no_grad():
        mean = x @ m_w[0] + m_b
        var = (x**2) @ s_w[0] ** 2 + s_b**2 + 0.25
        exact_rows = torch.distributions.Normal(mean, var.sqrt()).log_prob(y)
        exact = -exact_rows.mean().item()
    rows = predictive_log_density(model, guide, x, y, num_samples=4000)
    assert rows.shape == (40,)
    torch.testing.assert_close(rows, exact_rows, atol=0.03, rtol=0.08)  # tail rows: rarer draws
    estimate = predictive_nll(model, guide, x, y, num_samples=4000)
    assert estimate == -rows.mean().item()  # the same draws
    assert estimate == pytest.approx(exact, abs=0.01)
    # few draws: the log of a Monte Carlo mean reads high (Jensen), by more than the noise
    assert predictive_nll(model, guide, x, y, num_samples=2) > exact


def test_predictive_nll_fixed_draws_leave_the_global_generator_alone():
    x, y = torch.randn(20, 2), torch.randn(20)
    model = Linear(2, sigma=1.0)
    guide = AutoNormal(model, init_scale=0.3)
    guide(x, y)
    torch.manual_seed(7)
    a = predictive_nll(model, guide, x, y, num_samples=5, seed=3)
    after_call = torch.randn(4)
    torch.manual_seed(7)
    assert torch.equal(torch.randn(4), after_call)  # as if the call had not happened
    assert predictive_nll(model, guide, x, y, num_samples=5, seed=3) == a
    assert predictive_nll(model, guide, x, y, num_samples=5, seed=4) != a
    with pytest.raises(ValueError, match="observed"):
        predictive_nll(model, guide, x, None, num_samples=2)  # obs not observed
    with pytest.raises(ValueError, match="observed"):
        predictive_nll(model, guide, x, y, site="fc.weight", num_samples=2)
    with pytest.raises(ValueError, match="num_samples"):
        predictive_nll(model, guide, x, y, num_samples=0)


@pytest.mark.parametrize("kind", ["dvi", "autonormal"])
def test_checkpoint_of_a_real_svi_run_restores_the_best_validation_score(kind):
    swap = load_recipe("pyro_classifier_swap")
    x, y, _, _ = swap.load("cancer", 0)
    x_fit, y_fit, x_val, y_val = swap.split_validation(x, y.float(), 0.2, 0)
    model = swap.Classifier(x.shape[1], 1, "bernoulli", hidden=8)
    if kind == "dvi":
        guide, loss = DeterministicGuide(model), DeterministicELBO()
    else:
        guide, loss = AutoNormal(model), Trace_ELBO()
    svi = SVI(model, guide, pyro.optim.Adam({"lr": 0.05}), loss)

    def score() -> float:
        return predictive_nll(model, guide, x_val, y_val, num_samples=8)

    checkpoint = ValidationCheckpoint(score, every=4, params=guide)
    for step in range(1, 41):
        svi.step(x_fit, y_fit)
        checkpoint.update(step)
    last = score()
    assert len(checkpoint.history) == 10 and last == checkpoint.history[-1][1]
    best = checkpoint.restore()
    assert checkpoint.best_score == min(s for _, s in checkpoint.history)
    assert score() == checkpoint.best_score  # the same fixed draws at the restored parameters
    if best != 40:
        assert score() < last


def test_swap_recipe_validation_protocol_writes_the_checkpoint(tmp_path):
    import json

    swap = load_recipe("pyro_classifier_swap")
    out = tmp_path / "rows.jsonl"
    swap.main(
        [
            *("--data", "cancer", "--likelihood", "bernoulli", "--steps", "12"),
            *("--protocol", "validation", "--val-every", "4", "--val-draws", "4"),
            *("--final-draws", "200", "--check-draws", "2", "--json", str(out)),
        ]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["guide"] for r in rows] == ["dvi", "autonormal"]
    for r in rows:
        steps = [s for s, _ in r["val_history"]]
        assert steps == [4, 8, 12]
        assert r["best_val_nll"] == min(v for _, v in r["val_history"])
        assert r["best_step"] in steps and r["protocol"] == "validation"
        assert r["nll"] > 0.0 and r["nll_last"] > 0.0 and 0.0 <= r["acc_last"] <= 1.0
    # the trace records each evaluation without changing the run (its draws are forked)
    traced = tmp_path / "traced.jsonl"
    swap.main(
        [
            *("--data", "cancer", "--likelihood", "bernoulli", "--steps", "12"),
            *("--protocol", "validation", "--val-every", "4", "--val-draws", "4"),
            *("--final-draws", "200", "--check-draws", "2", "--json", str(traced)),
            *("--trace-evals", "--trace-draws", "50"),
        ]
    )
    for plain, r in zip(
        rows, [json.loads(line) for line in traced.read_text().splitlines()], strict=True
    ):
        assert r["val_history"] == plain["val_history"]
        assert (r["nll"], r["nll_last"], r["true"]) == (
            plain["nll"],
            plain["nll_last"],
            plain["true"],
        )
        assert len(r["trace"]) == 3 and len(r["trace"][0]["val_log_p"]) == round(0.2 * 443)
        for (_, value), row in zip(r["val_history"], r["trace"], strict=True):
            mean = -sum(row["val_log_p"]) / len(row["val_log_p"])
            assert mean == pytest.approx(value, abs=1e-5)


def test_replay_recipe_reproduces_the_recorded_best_states(tmp_path):
    swap = load_recipe("pyro_classifier_swap")
    replay = load_recipe("pyro_validation_replay")
    runs = tmp_path / "runs.jsonl"
    swap.main(
        [
            *("--data", "cancer", "--likelihood", "bernoulli", "--steps", "12", "--seed", "1"),
            *("--protocol", "validation", "--val-every", "3", "--val-draws", "4"),
            *("--final-draws", "100", "--check-draws", "2", "--json", str(runs)),
        ]
    )
    args = ["--data", "cancer", "--seed", "1", "--runs", str(runs), "--draws", "100"]
    result = replay.main([*args, "--repeats", "2"])
    for kind in ("dvi", "autonormal"):
        r = result[kind]
        assert r["val_nll"] == r["recorded_val_nll"]  # the same state, step for step
        assert len(r["nll"]) == 2 and r["nll"][0] != r["nll"][1]  # independent draw sets
