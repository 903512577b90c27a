"""PairedEarlyStopping (issue 45): which early-stopped step is kept, and when the run stops."""

from __future__ import annotations

import math
from types import SimpleNamespace

import lightning
import numpy as np
import pytest
import torch
from helpers import overfit_fit, overfit_loaders
from scipy import stats

from lightning_dvi import DVIRegressor
from lightning_dvi.callbacks import PairedEarlyStopping, RestoreBestWeights


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread: a second one only contends for the 2 shared cores."""


class _Module(torch.nn.Module):
    """A stand-in whose ``state_dict`` names the step it was at."""

    def __init__(self) -> None:
        super().__init__()
        self.step = torch.nn.Parameter(torch.zeros(()))


def _feed(callback: PairedEarlyStopping, steps: list[np.ndarray]) -> list[bool]:
    module, kept = _Module(), []
    for k, rows in enumerate(steps):
        with torch.no_grad():
            module.step.fill_(k)
        kept.append(callback.decide(torch.as_tensor(rows, dtype=torch.float64), module))
    return kept


@pytest.mark.parametrize("z", [0.0, 0.5, 1.0, 2.0])
def test_a_step_is_kept_unless_the_paired_t_statistic_is_below_minus_z(z):
    """Oracle: scipy's paired t statistic against the best step so far."""
    rng = np.random.default_rng(0)
    best = rng.normal(-1.0, 1.0, size=40)
    steps = [best]
    for shift in (0.05, 0.1, 0.2, 0.4, 0.8):  # ever more worse than the first, with noise
        steps.append(best - shift + rng.normal(0.0, 0.5, size=40))
    callback = PairedEarlyStopping(z=z, patience=100)
    kept = _feed(callback, steps)
    reference = 0  # the best mean so far
    for k in range(1, len(steps)):
        t = stats.ttest_rel(steps[k], steps[reference]).statistic
        new_best = steps[k].mean() > steps[reference].mean()
        assert kept[k] == (t >= -z or new_best), (k, t)
        reference = k if new_best else reference
    assert callback.best_step == reference
    assert not all(kept) and any(kept[1:])  # the case tells the rule from "always" and "never"
    last_kept = max(k for k, ok in enumerate(kept) if ok)
    assert callback.kept_step == last_kept
    # the restored weights are the last kept step's
    assert float(callback._kept_state["step"]) == last_kept


def test_a_larger_carve_out_resolves_a_difference_a_small_one_cannot():
    """The same per-row shift of 0.1 nats: kept on 20 rows, refused on 2000 (the rule adapts)."""
    rng = np.random.default_rng(1)
    verdicts = {}
    for n in (20, 2000):
        best = rng.normal(-1.0, 1.0, size=n)
        later = best - 0.1 + rng.normal(0.0, 0.5, size=n)
        verdicts[n] = _feed(PairedEarlyStopping(z=1.0), [best, later])[1]
    assert verdicts == {20: True, 2000: False}


def test_skipped_first_steps_cannot_become_the_reference_best():
    """With skip=3 a transiently good second step is not the reference the later steps must beat."""
    rows = np.zeros(30)
    means = [-3.0, -1.0, -2.5, -2.0, -1.9, -2.2]  # step 1 is the best mean, but skipped
    steps = [rows + m + np.linspace(-0.01, 0.01, 30) for m in means]
    plain, skipping = PairedEarlyStopping(z=0.0), PairedEarlyStopping(z=0.0, skip=3)
    _feed(plain, steps)
    _feed(skipping, steps)
    assert plain.best_step == 1 and plain.kept_step == 1
    assert skipping.best_step == 4 and skipping.kept_step == 4


def test_patience_counts_new_bests_or_kept_steps():
    """``"best"``: Lightning's count; ``"kept"``: steps the carve-out shows worse, in a row."""
    rng = np.random.default_rng(2)
    best = rng.normal(-1.0, 1.0, size=200)
    # after the best, four steps indistinguishable from it, then clearly worse ones
    wiggle = 0.01 * np.resize([1.0, -1.0], 200) - 1e-6  # mean -1e-6, t about -0.001
    steps = [best - 1.0, best] + [best + wiggle for _ in range(4)]
    steps += [best - 1.0] * 3
    for on, stop_at in (("best", 4), ("kept", 8)):
        callback = PairedEarlyStopping(patience=3, z=1.0, patience_on=on)
        since = []
        for k in range(len(steps)):
            _feed_one(callback, steps[k], k)
            since.append(callback._since)
        first_stop = next(k for k, s in enumerate(since) if s >= 3)
        assert first_stop == stop_at, (on, since)


def _feed_one(callback: PairedEarlyStopping, rows: np.ndarray, k: int) -> None:
    module = _Module()
    with torch.no_grad():
        module.step.fill_(k)
    callback.decide(torch.as_tensor(rows, dtype=torch.float64), module)


def _stops_at(callback: PairedEarlyStopping, steps: list[np.ndarray]) -> int | None:
    """Feed ``steps`` through the callback's end-of-validation hook; the index it stops at."""
    module = _Module()
    trainer = SimpleNamespace(sanity_checking=False, world_size=1, should_stop=False)
    for k, rows in enumerate(steps):
        with torch.no_grad():
            module.step.fill_(k)
        callback._rows = [torch.as_tensor(rows, dtype=torch.float64)]
        callback.on_validation_epoch_end(trainer, module)  # type: ignore[arg-type]
        if trainer.should_stop:
            assert callback.stopped_step == k
            return k
    return None


@pytest.mark.parametrize(
    ("best", "growth", "stop"),
    # stop = best + max(patience, ceil(growth * best)), patience 3, written out by hand
    [(29, 0.0, 32), (29, 0.1, 32), (29, 0.2, 35), (29, 0.5, 44), (4, 0.5, 7), (40, 0.25, 50)],
)
def test_the_patience_grows_with_the_best_steps_index(best, growth, stop):
    """``patience_growth``: a new best at step ``best``, then only clearly worse steps."""
    rng = np.random.default_rng(5)
    base = rng.normal(-1.0, 1.0, size=50)
    steps = [base + 0.1 * k for k in range(best + 1)]  # a new best every step up to `best`
    steps += [base - 1.0] * 30  # then steps shown worse, never a new best
    callback = PairedEarlyStopping(patience=3, z=0.5, patience_growth=growth)
    assert _stops_at(callback, steps) == stop
    assert callback.best_step == best and callback.kept_step == best
    assert callback.current_patience == stop - best


def test_a_non_finite_step_is_never_kept():
    callback = PairedEarlyStopping(z=5.0)
    steps = [np.full(10, -1.0), np.array([-1.0] * 9 + [math.nan])]
    assert _feed(callback, steps) == [True, False]
    assert callback.kept_step == 0


@pytest.mark.parametrize("z", [0.0, 0.5, 1.0])
def test_with_trim_both_comparisons_use_the_trimmed_paired_differences(z):
    """Oracle: scipy's one-sample t statistic of the differences without their extremes."""
    rng = np.random.default_rng(4)
    first = rng.normal(-1.0, 1.0, size=30)
    steps = [first]
    for shift in (-0.05, 0.0, 0.1, 0.2, 0.4):
        later = first - shift + rng.normal(0.0, 0.4, size=30)
        later[rng.integers(30)] -= 20.0  # one row far outside the predictive
        steps.append(later)
    callback = PairedEarlyStopping(z=z, patience=100, trim=1)
    kept = _feed(callback, steps)
    reference = 0
    for k in range(1, len(steps)):
        d = np.sort(steps[k] - steps[reference])[1:-1]
        t = stats.ttest_1samp(d, 0.0).statistic
        new_best = d.mean() > 0
        assert kept[k] == (t >= -z or new_best), (k, t)
        reference = k if new_best else reference
    assert callback.best_step == reference
    assert not all(kept) and any(kept[1:])
    untrimmed = PairedEarlyStopping(z=z, patience=100)
    _feed(untrimmed, steps)
    assert untrimmed.best_step != callback.best_step  # the case tells trim=1 from trim=0


def test_one_row_alone_cannot_stop_the_later_steps_with_trim():
    """Every row but one improves; that one loses 40 nats: trim=0 keeps the first step, trim=1 the last."""
    base = np.linspace(-2.0, 0.0, 40)
    steps = [base]
    for k in range(1, 6):
        later = base + 0.05 * k
        later[0] = base[0] - 40.0 * k
        steps.append(later)
    plain, trimmed = PairedEarlyStopping(z=0.5), PairedEarlyStopping(z=0.5, trim=1)
    _feed(plain, steps)
    _feed(trimmed, steps)
    assert (plain.best_step, plain.kept_step) == (0, 0)
    assert (trimmed.best_step, trimmed.kept_step) == (5, 5)
    # the same row set aside is what a larger carve-out would dilute: the means disagree
    assert steps[5].mean() < steps[0].mean()


def test_trim_is_ignored_on_too_few_rows():
    """Four rows with trim=2 leave none to compare: the untrimmed rule decides."""
    steps = [np.array([-1.0, -1.0, -1.0, -1.0]), np.array([-1.1, -0.5, -0.5, -3.0])]
    assert _feed(PairedEarlyStopping(z=0.0, trim=2), steps) == _feed(
        PairedEarlyStopping(z=0.0), steps
    )


def test_bad_arguments_are_refused():
    for kwargs in ({"patience": 0}, {"z": -1.0}, {"z": math.inf}, {"skip": -1},
                   {"patience_on": "mean"}, {"min_steps": 1.5}, {"trim": -1},
                   {"patience_growth": -0.1}, {"patience_growth": math.inf},
                   {"patience_growth": True}):  # fmt: skip
        with pytest.raises(ValueError, match="PairedEarlyStopping"):
            PairedEarlyStopping(**kwargs)


def _fit(callbacks: list, epochs: int = 12) -> DVIRegressor:
    model: DVIRegressor = overfit_fit(callbacks, epochs)
    return model


def test_in_a_fit_the_restored_weights_score_the_kept_steps_validation_rows():
    paired = PairedEarlyStopping(patience=100, z=1.0)
    model = _fit([paired])
    assert len(paired.history) == 12 and paired.stopped_step is None
    _, val = overfit_loaders()
    x, y = val.dataset.tensors
    model.eval()
    mean = float(model.predictive_log_prob(x, y).mean())
    assert mean == pytest.approx(paired.history[paired.kept_step][0], rel=1e-6)
    assert paired.history[paired.kept_step][1]  # it was kept


def test_with_z_0_it_keeps_lightnings_best_step_and_stops_when_lightning_would():
    """z=0 and patience on the best mean: the choice and stop of EarlyStopping + RestoreBestWeights."""
    paired = PairedEarlyStopping(patience=3, z=0.0)
    ours = _fit([paired], epochs=30)
    restore = RestoreBestWeights("val/nll")
    stop = lightning.pytorch.callbacks.EarlyStopping("val/nll", patience=3)
    theirs = _fit([stop, restore], epochs=30)
    assert paired.kept_step == paired.best_step == restore.best_epoch
    assert paired.stopped_step == stop.stopped_epoch
    for key, value in theirs.state_dict().items():
        torch.testing.assert_close(ours.state_dict()[key], value)


def test_state_round_trip_keeps_the_decision():
    callback = PairedEarlyStopping(z=1.0)
    rng = np.random.default_rng(3)
    _feed(callback, [rng.normal(size=20) for _ in range(4)])
    again = PairedEarlyStopping(z=1.0)
    again.load_state_dict(callback.state_dict())
    assert (again.best_step, again.kept_step, again.history) == (
        callback.best_step,
        callback.kept_step,
        callback.history,
    )
