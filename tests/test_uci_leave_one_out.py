"""Issue 45: the leave-one-data-set-out selection, the unseen bundled sets, the recipe over them."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from helpers import load_recipe

from lightning_dvi.data import UCIDataModule
from lightning_dvi_benchmarks import uci
from lightning_dvi_benchmarks import uci_leave_one_out as loo
from lightning_dvi_benchmarks.uci_unseen import UNSEEN_REGRESSION, write_standard_layout

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "uci_leave_one_out.py"


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread: a second one only contends for the 2 shared cores."""


def test_diabetes_in_the_standard_layout_reads_back_with_disjoint_covering_splits(tmp_path):
    x, y = UNSEEN_REGRESSION["diabetes"]()
    assert x.shape == (442, 10) and y.shape == (442,)
    folder = write_standard_layout(tmp_path / "diabetes", x, y, n_splits=3)
    for k in range(3):
        train = np.loadtxt(folder / f"index_train_{k}.txt", dtype=int)
        test = np.loadtxt(folder / f"index_test_{k}.txt", dtype=int)
        assert len(test) == 44 and not set(train) & set(test)
        assert sorted([*train, *test]) == list(range(442))
    dm = UCIDataModule(str(tmp_path), "diabetes", split=2)
    dm.setup("fit")
    dm.setup("test")
    assert dm.num_train == 398 and dm.in_features == 10
    rows = np.loadtxt(folder / "index_test_2.txt", dtype=int)
    np.testing.assert_allclose(dm.test_dataset.tensors[1].numpy().reshape(-1), y[rows], rtol=1e-9)
    # the same folder on every machine: the splits come from the seed alone
    again = write_standard_layout(tmp_path / "again", x, y, n_splits=3)
    assert (again / "index_test_1.txt").read_text() == (folder / "index_test_1.txt").read_text()


def _record(candidate: str, dataset: str, split: int, ll: float, cpu: float = 1.0) -> dict:
    return {"candidate": candidate, "dataset": dataset, "split": split, "test_ll": ll,
            "cpu_seconds": cpu, "steps": 3}  # fmt: skip


def test_the_choice_never_looks_at_the_held_out_set():
    """Candidate "b" wins on sets A and B, "c" only on the held-out C: C gets "b"'s score."""
    reference = {d: {0: 0.0, 1: 0.0} for d in "ABC"}
    records = []
    for d in "ABC":
        for k in (0, 1):
            records.append(_record("today", d, k, -0.1))
            records.append(_record("b", d, k, 0.0 if d != "C" else -0.5))
            records.append(_record("c", d, k, -0.2 if d != "C" else 0.5))
    rows = loo.leave_one_out(records, reference, ["C", "A"], ["A", "B", "C"])
    c, a = rows
    assert c["chosen"] == "b" and c["selection_sets"] == ["A", "B"]
    assert c["score"]["difference"] == pytest.approx(-0.5)
    assert c["today"]["difference"] == pytest.approx(-0.1)
    # on B and C each of b and c meets one set; c trails Adam less on its worse one
    assert a["chosen"] == "c" and a["selection_sets"] == ["B", "C"]


def test_the_rule_counts_sets_meeting_both_lines_then_the_worst_mean_then_cost():
    def scores(by: dict) -> dict:
        out = {}
        for name, sets in by.items():
            for d, (diff, worst, cpu) in sets.items():
                out.setdefault(name, {})[d] = loo.SetScore(d, name, 10, diff, 0.0, 0, worst, cpu)
        return out

    table = {
        "today": {"A": (-0.05, -0.5, 1.0), "B": (0.0, -0.1, 1.0)},
        "fast": {"A": (-0.02, -0.2, 1.4), "B": (0.01, -0.1, 1.4)},  # meets both lines on both
        "dear": {"A": (0.05, -0.1, 2.0), "B": (0.05, -0.1, 1.0)},  # better, but 2x on A
        "edgy": {"A": (-0.02, -0.31, 1.0), "B": (0.2, 0.0, 1.0)},  # a split past 0.3 on A
    }
    assert loo.choose(scores(table), ["A", "B"]) == "fast"
    assert loo.choose(scores(table), ["A", "B"], cost_limit=3.0) == "dear"
    assert loo.choose(scores(table), ["B"]) == "edgy"  # all meet on B: the best worst mean
    tie = {"today": table["today"], "x": table["fast"], "y": table["fast"]}
    tie["y"] = {d: (a, b, c * 0.9) for d, (a, b, c) in table["fast"].items()}
    assert loo.choose(scores(tie), ["A", "B"]) == "y"  # equal quality: the cheaper


def _stop_and_keep(callback, trace: list, module) -> tuple[int, int]:
    """Feed per-row log-likelihoods to ``callback`` as its Trainer would; (stopped, kept) step."""
    import torch

    for index, rows in enumerate(trace):
        callback.decide(torch.as_tensor(rows), module)
        if callback._since >= callback.current_patience:
            return index, callback.kept_step
    return len(trace) - 1, callback.kept_step


def test_stops_no_earlier_holds_on_random_traces_and_only_for_longer_waits():
    """The order of the candidates' patience settings, checked against the callback itself.

    Oracle: the callback fed random traces of per-row log-likelihoods (slow drifts with
    plateaus and single outlying rows), one callback per setting: where ``stops_no_earlier(a,
    b)``, a's run stops at b's step or later on every trace and keeps the same step when it
    stops at the same one.
    """
    import torch

    from lightning_dvi.callbacks import PairedEarlyStopping

    c = loo.CANDIDATES
    pairs = [("paired-trim1-grow", "paired-trim1"), ("paired-trim1-kept", "paired-trim1"),
             ("paired-kept", "paired"), ("paired-trim1-grow", "paired-trim1-grow")]  # fmt: skip
    for a, b in pairs:
        assert loo.stops_no_earlier(c[a], c[b])
    assert not loo.stops_no_earlier(c["paired-trim1"], c["paired-trim1-grow"])
    assert not loo.stops_no_earlier(c["paired-trim1"], c["paired-trim1-kept"])
    assert not loo.stops_no_earlier(c["paired-trim1-kept"], c["paired-trim1-grow"])
    assert not loo.stops_no_earlier(c["paired-trim1-grow"], c["paired-skip3"])  # trim differs
    assert not loo.stops_no_earlier(c["paired-trim1-grow"], c["today"])  # not paired
    assert loo.stops_no_earlier(replace(c["paired"], patience=8), c["paired"])

    def callback(s):
        return PairedEarlyStopping(patience=s.patience, z=s.selection_z, skip=s.selection_skip,
                                   patience_on=s.patience_on, trim=s.selection_trim,
                                   patience_growth=s.patience_growth)  # fmt: skip

    module = torch.nn.Linear(1, 1)
    rng = np.random.default_rng(3)
    settings = {**c, "paired-trim1-p8": replace(c["paired-trim1"], patience=8),
                "paired-trim1-grow3": replace(c["paired-trim1-grow"], patience_growth=0.3)}  # fmt: skip
    names = [n for n, s in settings.items() if s.selection == "paired"]
    later = same = 0
    for _ in range(40):
        steps = 120
        drift = np.cumsum(rng.exponential(0.02, steps) * (rng.random(steps) < 0.3))
        trace = [drift[t] + 0.05 * rng.normal(size=30) for t in range(steps)]
        for t in rng.choice(steps, size=3):
            trace[t][rng.integers(30)] -= 20.0  # one row far off
        runs = {n: _stop_and_keep(callback(settings[n]), trace, module) for n in names}
        for a in names:
            for b in names:
                if loo.stops_no_earlier(settings[a], settings[b]):
                    assert runs[a][0] >= runs[b][0]
                    if runs[a][0] == runs[b][0]:
                        assert runs[a][1] == runs[b][1]
                        same += a != b
                    else:
                        later += 1
    assert later > 0 and same > 0  # both cases occur on these traces


def test_candidates_with_the_same_runs_are_one_for_the_cost_tie_break():
    """Same test LL and steps on every selection split: not the CPU time, the later stop decides."""

    def score(name, d, lls, cpu, steps=(10, 10)):
        runs = tuple((k, ll, n) for k, (ll, n) in enumerate(zip(lls, steps, strict=True)))
        worst = min(lls)
        return loo.SetScore(d, name, 2, sum(lls) / 2, 0.0, 0, worst, cpu, runs)

    def table(cpu):
        out = {
            name: {d: score(name, d, (-0.01, -0.02), cpu[name]) for d in "AB"}
            for name in ("today", "paired-trim1", "paired-trim1-grow")
        }
        # today's rule: the same quality here, but other runs (other steps)
        out["today"] = {d: score("today", d, (-0.01, -0.02), cpu["today"], (9, 9)) for d in "AB"}
        return out

    cpu = {"today": 1.15, "paired-trim1": 1.0, "paired-trim1-grow": 1.2}
    # identical runs: the cheaper CPU time of one sitting does not decide
    assert loo.choose(table(cpu), ["A", "B"]) == "paired-trim1-grow"
    # without settings no member is known to stop no earlier: the group's cheapest
    assert loo.choose(table(cpu), ["A", "B"], settings={}) == "paired-trim1"
    # today's other runs are a group of their own, compared by CPU time with the group's mean
    assert loo.choose(table({**cpu, "today": 1.05}), ["A", "B"]) == "today"  # < (1.0 + 1.2) / 2
    # one split with other steps: no longer the same runs, the CPU time decides again
    scores = table(cpu)
    scores["paired-trim1-grow"]["B"] = score("paired-trim1-grow", "B", (-0.01, -0.02), 1.2,
                                             (10, 12))  # fmt: skip
    assert loo.choose(scores, ["A", "B"]) == "paired-trim1"
    # runs not known (records without per-split values): never the same
    blind = {n: {d: replace(v, runs=()) for d, v in by.items()} for n, by in table(cpu).items()}
    assert loo.choose(blind, ["A", "B"]) == "paired-trim1"


def test_score_set_compares_split_by_split_and_names_the_worst():
    reference = {"A": {0: -1.0, 1: -2.0, 2: -3.0}}
    records = [_record("p", "A", 0, -1.1), _record("p", "A", 1, -1.5), _record("p", "A", 5, 9.0)]
    s = loo.score_set(records, reference, "A", "p")
    assert s.splits == 2 and s.worst_split == 0 and s.worst_difference == pytest.approx(-0.1)
    assert s.difference == pytest.approx((-1.1 - 1.5) / 2 - (-1.5))
    assert loo.score_set(records, reference, "B", "p") is None


def test_adam_runs_in_the_records_give_the_reference_of_a_set_without_figures(tmp_path):
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"results": [
        {"dataset": "A", "method": "dvi", "splits": [{"split": 0, "test_ll": -1.0}]},
        {"dataset": "A", "method": "mcvi", "splits": [{"split": 0, "test_ll": -9.0}]},
    ]}))  # fmt: skip
    reference = loo.adam_reference(path, [_record("adam8000", "D", 3, -0.5)])
    assert reference == {"A": {0: -1.0}, "D": {3: -0.5}}


def test_the_recipe_runs_resumes_and_reports_on_toy_sets(tmp_path, capsys):
    """Two toy sets, two candidates, one split each, through the real runner; a rerun runs nothing."""
    rng = np.random.default_rng(0)
    for name in ("one", "two"):
        x = rng.normal(size=(80, 3))
        y = 5.0 + x[:, 0] - 2 * x[:, 1] + 0.3 * rng.normal(size=80)
        write_standard_layout(tmp_path / "data" / name, x, y, n_splits=1)
    spec = importlib.util.spec_from_file_location("uci_leave_one_out_recipe", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules["uci_leave_one_out_recipe"] = recipe
    spec.loader.exec_module(recipe)
    short = {k: replace(v, max_steps=3, patience=2) for k, v in loo.CANDIDATES.items()}
    recipe.CANDIDATES = {k: short[k] for k in ("today", "paired")}
    reference = tmp_path / "ref.json"
    reference.write_text(json.dumps({"results": [
        {"dataset": d, "method": "dvi", "splits": [{"split": 0, "test_ll": -1.0}]}
        for d in ("one", "two")
    ]}))  # fmt: skip
    out = tmp_path / "loo.jsonl"
    argv = ["--data-dir", str(tmp_path / "data"), "--datasets", "one,two", "--candidates",
            "today,paired", "--splits", "1", "--output", str(out), "--reference", str(reference),
            "--report", "--held-out", "one,two", "--selection-pool", "one,two",
            "--json", str(tmp_path / "loo.json")]  # fmt: skip
    assert recipe.main(argv) == 0
    lines = loo.load_records(out)
    assert {(r["candidate"], r["dataset"]) for r in lines} == {
        (c, d) for c in ("today", "paired") for d in ("one", "two")
    }
    assert all(r["split"] == 0 and r["seed"] == 0 and r["steps"] <= 3 for r in lines)
    assert {r["kept_step"] is None for r in lines if r["candidate"] == "today"} == {True}
    rows = json.loads((tmp_path / "loo.json").read_text())
    assert [r["selection_sets"] for r in rows] == [["two"], ["one"]]
    assert "chosen" in capsys.readouterr().out
    recipe.main(argv)  # everything is in the file: nothing runs again
    assert len(loo.load_records(out)) == 4


def test_every_candidate_is_a_runner_setting_and_today_is_the_pre_issue_45_protocol():
    today = loo.CANDIDATES["today"]
    assert today.selection == "best" and today.patience == 5
    selection = {"selection": "best", "selection_z": 0.5, "selection_skip": 0,
                 "patience_on": "best", "selection_trim": 0, "patience_growth": 0.0}  # fmt: skip
    assert {k: getattr(today, k) for k in selection} == selection
    # everything else is the runner's default: whatever the default's selection rule, `today`
    # (and every candidate built on it) stays the same protocol
    assert replace(uci.PRESETS["lbfgs"], **selection) == today
    assert len(loo.CANDIDATES) == len({v for v in loo.CANDIDATES.values()})


def test_the_runners_default_is_the_leave_one_out_choice():
    """Issue 45: the default protocol is the candidate chosen leave-one-data-set-out."""
    assert uci.DEFAULTS == uci.PRESETS["lbfgs"] == loo.CANDIDATES["paired-trim1-kept"]
    # --preset lbfgs-best: today's rule with the full-batch protocol at every size (large_rows=0)
    assert uci.PRESETS["lbfgs-best"] == replace(loo.CANDIDATES["today"], large_rows=0)


@pytest.mark.parametrize(
    ("name", "patience_on", "growth", "mixture"),
    [
        ("paired-trim1", "best", 0.0, 0),
        ("paired-trim1-kept", "kept", 0.0, 0),
        ("paired-trim1-grow", "best", 0.1, 0),
        ("paired-trim1-kept-mix", "kept", 0.0, 16),
    ],
)
def test_the_runner_hands_the_candidates_selection_settings_to_the_callback(
    tmp_path, monkeypatch, name, patience_on, growth, mixture
):
    """run_job builds PairedEarlyStopping with the candidate's z, skip, trim, patience_on, growth, mixture."""
    import lightning_dvi.callbacks as callbacks

    seen = []

    class Recording(callbacks.PairedEarlyStopping):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            seen.append(kwargs)

    monkeypatch.setattr(callbacks, "PairedEarlyStopping", Recording)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(80, 3))
    write_standard_layout(tmp_path / "toy", x, x[:, 0] + 0.3 * rng.normal(size=80), n_splits=1)
    settings = replace(loo.CANDIDATES[name], max_steps=2, patience=1)
    assert settings == replace(loo.CANDIDATES["paired-skip3"], selection_trim=1, max_steps=2,
                               patience=1, patience_on=patience_on,
                               patience_growth=growth, selection_mixture=mixture)  # fmt: skip
    job = uci.Job(str(tmp_path), "toy", "dvi", 0, 8, 0.0, None, settings)
    result = uci.run_job(job)
    assert seen == [{"patience": 1, "z": 0.5, "skip": 3, "patience_on": patience_on, "trim": 1,
                     "patience_growth": growth, "mixture": mixture}]  # fmt: skip
    assert result["kept_step"] is not None
    if mixture == 0:
        assert result["mixture_steps"] is None
    else:  # the window the carve-out chose among this run's (at most 2) kept steps
        assert result["mixture_steps"] in (1, 2)


def test_the_step_trace_replays_the_default_runs_choice(tmp_path):
    """recipes/uci_step_trace.py: the step the default restores scores the run's own test LL."""
    recipe = load_recipe("uci_step_trace")
    rng = np.random.default_rng(2)
    x = rng.normal(size=(120, 3))
    write_standard_layout(tmp_path / "toy", x, x[:, 0] + 0.3 * rng.normal(size=120), n_splits=1)
    out = tmp_path / "trace.jsonl"
    argv = ["--data-dir", str(tmp_path), "--datasets", "toy", "--patience", "3", "--output",
            str(out)]  # fmt: skip
    assert recipe.main(argv) == 0
    (line,) = loo.load_records(out)
    steps, kept = line["steps"], line["result"]["kept_step"]
    assert len(steps[0]["val"]) == 11 and len(steps[0]["test"]) == 12  # 10 % carve-out, 10 % test
    assert np.mean(steps[kept]["test"]) == pytest.approx(line["result"]["test_ll"], abs=1e-4)
    assert [s["cpu"] for s in steps] == sorted(s["cpu"] for s in steps)
    recipe.main(argv)  # already there: nothing runs again
    assert len(loo.load_records(out)) == 1


def test_the_density_recipe_scores_the_runners_fit_both_ways(tmp_path):
    """recipes/predictive_density.py: the extra scores leave the run and its test LL alone."""
    recipe = load_recipe("predictive_density")
    rng = np.random.default_rng(4)
    x = rng.normal(size=(120, 3))
    y = x[:, 0] + 0.3 * rng.normal(size=120) * (1 + (x[:, 1] > 1))
    write_standard_layout(tmp_path / "toy", x, y, n_splits=1)
    out = tmp_path / "density.jsonl"
    argv = ["--data-dir", str(tmp_path), "--dataset", "toy", "--candidates",
            "paired-trim1-kept", "--splits", "1", "--steps-cap", "4", "--output", str(out)]  # fmt: skip
    assert recipe.main(argv) == 0
    (line,) = loo.load_records(out)
    assert line["candidate"] == "paired-trim1-kept" and line["median_var_l"] > 0
    job = uci.make_jobs(tmp_path, ["toy"], ["dvi"], loo.CANDIDATES["paired-trim1-kept"], 1,
                        steps_cap=4)[0]  # fmt: skip
    plain = uci.run_job(job)  # the same run without the hook: the same fit and score
    assert plain["test_ll"] == line["test_ll"] and plain["steps"] == line["steps"]
    assert line["gaussian_ll"] != line["test_ll"]  # two densities of one fit
    recipe.main(argv)  # already there: nothing runs again
    assert len(loo.load_records(out)) == 1
