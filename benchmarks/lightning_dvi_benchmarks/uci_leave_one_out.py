r"""Leave-one-data-set-out selection of the regression protocol (issue 45).

A protocol fixed by looking at some data sets is fitted to them; its honest score is on a set
it was not chosen on. For each held-out set :math:`S`, one protocol is chosen from a small, fixed
list (:data:`CANDIDATES`) by a fixed rule (:func:`choose`) on the other sets only, then scored on
:math:`S`; every set takes the held-out place in turn.

Every run is one :func:`lightning_dvi_benchmarks.uci.run_job` (the user's code path: a
``DVIRegressor`` in ``lightning.Trainer`` on a ``UCIDataModule``), one per (candidate, set,
split), written as one JSON line as it finishes (:func:`run_grid`), so a killed run keeps what
it did and a rerun skips what is there. The reference is the 8000-step Adam protocol
(``--preset adam8000``) on the same split: the shared sets' per-split figures in
``docs/uci_results.json``, or ``adam8000`` lines in the same file (sets not in it).

The rule (:func:`choose`), fixed before any figure was seen: on the selection sets, a
candidate whose CPU seconds per split exceed ``cost_limit`` times those of ``"today"`` (the
protocol before issue 45) on any selection set is out; among the others, the most sets
meeting both acceptance lines (mean test LL at most ``mean_line`` below Adam's, no split more
than ``split_line`` below Adam's on the same split) wins; ties go to the larger worst-set mean
difference against Adam, then to the lower total CPU time.

Candidates the selection sets cannot tell apart (fourth pass, issue 45): two candidates whose
runs give the same test LL and the same number of ELBO steps on every selection split ran the
same steps, so their CPU seconds measure the load of two sittings, not the rules. Such a group
counts as one for the cost tie-break (the mean of its members' CPU time), and within it the
candidate whose stopping rule stops no earlier than every other member's on any run
(:func:`stops_no_earlier`) is chosen: no selection run reached a step where the members would
differ, so the selection data hold no evidence for the earlier stop, and the later one cost
nothing on them. This tie-break was added after the third pass had shown the CPU tie-break
deciding energy's held-out choice between two such candidates (docs/uci_protocol.md): it is
not blind to that case.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from .uci import DEFAULTS, Job, Settings, dataset_folder, hidden_width, run_job

__all__ = [
    "CANDIDATES",
    "SetScore",
    "adam_reference",
    "choose",
    "leave_one_out",
    "load_records",
    "run_grid",
    "score_set",
    "stops_no_earlier",
]

# every selection field written out, so that a change of the runner's default changes no candidate
_TODAY = replace(
    DEFAULTS,
    selection="best",
    selection_z=0.5,
    selection_skip=0,
    patience_on="best",
    selection_trim=0,
    patience_growth=0.0,
)

# The fixed list: today's protocol and nine per-run rules for which step to keep (issue 45).
#: ``paired-trim1`` with its patience counted on the kept steps (see :data:`CANDIDATES`).
_PAIRED_KEPT = replace(
    _TODAY,
    selection="paired",
    selection_z=0.5,
    selection_skip=3,
    selection_trim=1,
    patience_on="kept",
)

CANDIDATES: dict[str, Settings] = {
    "today": _TODAY,
    "skip3": replace(_TODAY, selection="paired", selection_z=0.0, selection_skip=3),
    "paired": replace(_TODAY, selection="paired", selection_z=1.0),
    "paired-skip3": replace(_TODAY, selection="paired", selection_z=0.5, selection_skip=3),
    "paired-kept": replace(_TODAY, selection="paired", selection_z=1.0, patience_on="kept"),
    "paired-carve20": replace(
        _TODAY, selection="paired", selection_z=1.0, early_stopping_fraction=0.2
    ),
    # added after the first selection (energy split 5): paired-skip3, no single row deciding
    "paired-trim1": replace(
        _TODAY, selection="paired", selection_z=0.5, selection_skip=3, selection_trim=1
    ),
    # added after the second selection (energy's mean): paired-trim1 with a patience counted in
    # standard errors (the run stops after `patience` steps in a row each shown worse than the
    # best by more than z standard errors), or growing with the best step's index
    "paired-trim1-kept": _PAIRED_KEPT,
    "paired-trim1-grow": replace(
        _TODAY,
        selection="paired",
        selection_z=0.5,
        selection_skip=3,
        selection_trim=1,
        patience_growth=0.1,
    ),
    # added after the fifth selection (energy's figure follows the float rounding of an L-BFGS
    # path): paired-trim1-kept, the test rows scored by the mixture of the last kept steps'
    # predictives, the window (1, 2, 4, 8 or 16 steps) chosen on the carve-out
    "paired-trim1-kept-mix": replace(_PAIRED_KEPT, selection_mixture=16),
}


def _key(record: Mapping[str, Any]) -> tuple[str, str, int]:
    return str(record["candidate"]), str(record["dataset"]), int(record["split"])


def load_records(path: str | Path) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` (none if it does not exist); a torn last line is skipped."""
    path = Path(path)
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def run_grid(
    data_dir: str | Path,
    datasets: Sequence[str],
    candidates: Mapping[str, Settings],
    splits: Sequence[int],
    output: str | Path,
    seed: int = 0,
    report: Any = None,
) -> list[dict[str, Any]]:
    """Run every (candidate, dataset, split) not yet in ``output``, appending one JSON line each.

    Runs split by split, every candidate on a split before the next one, so that candidates'
    CPU seconds on a set are measured under the same load. Returns all records of ``output``
    afterwards. ``report(record)`` is called per new run.
    """
    done = {_key(r) for r in load_records(output)}
    data_dir = Path(data_dir)
    with Path(output).open("a") as out:
        for dataset in datasets:
            hidden = hidden_width(dataset_folder(data_dir, dataset))
            # every candidate on a split before the next split: CPU ratios under the same load
            for split in splits:
                for name, settings in candidates.items():
                    if (name, dataset, split) in done:
                        continue
                    job = Job(str(data_dir), dataset, "dvi", split, hidden, 0.0, None,
                              replace(settings, seed=seed))  # fmt: skip
                    result = run_job(job)
                    record = {"candidate": name, "dataset": dataset, "seed": seed, **result,
                              "time": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
                    out.write(json.dumps(record) + "\n")
                    out.flush()
                    if report is not None:
                        report(record)
    return load_records(output)


def adam_reference(
    results_json: str | Path, records: Iterable[Mapping[str, Any]] = ()
) -> dict[str, dict[int, float]]:
    """Per-set, per-split test LL of the 8000-step Adam protocol (method ``dvi``).

    From ``results_json`` (``docs/uci_results.json``'s layout) and from ``records`` whose
    candidate is ``"adam8000"`` (these win for a set present in both).
    """
    reference: dict[str, dict[int, float]] = {}
    data = json.loads(Path(results_json).read_text())
    for row in data["results"]:
        if row["method"] == "dvi":
            reference[row["dataset"]] = {
                int(s["split"]): float(s["test_ll"]) for s in row["splits"]
            }
    for r in records:
        if r["candidate"] == "adam8000":
            reference.setdefault(f"{r['dataset']}#run", {})[int(r["split"])] = float(r["test_ll"])
    for name in [k for k in reference if k.endswith("#run")]:
        reference[name.removesuffix("#run")] = reference.pop(name)
    return reference


@dataclass(frozen=True)
class SetScore:
    """One candidate on one set: means over the splits both it and Adam have."""

    dataset: str
    candidate: str
    splits: int
    test_ll: float
    adam: float
    worst_split: int
    worst_difference: float
    cpu_seconds: float
    runs: tuple[tuple[int, float, int | None], ...] = ()
    """``(split, test LL, ELBO steps)`` of each compared split (empty: not known)."""

    def same_runs(self, other: SetScore) -> bool:
        """Whether both gave the same test LL and steps on every split (known, and not empty)."""
        return bool(self.runs) and self.runs == other.runs

    @property
    def difference(self) -> float:
        """Mean test LL minus Adam's (positive: better than Adam)."""
        return self.test_ll - self.adam

    def meets(self, mean_line: float, split_line: float) -> bool:
        """Both acceptance lines: mean at most ``mean_line`` and every split at most ``split_line`` below Adam."""
        return self.difference >= -mean_line and self.worst_difference >= -split_line


def score_set(
    records: Iterable[Mapping[str, Any]],
    reference: Mapping[str, Mapping[int, float]],
    dataset: str,
    candidate: str,
    splits: Sequence[int] | None = None,
) -> SetScore | None:
    """The candidate's :class:`SetScore` on ``dataset`` (``None`` without a split to compare)."""
    adam = reference.get(dataset, {})
    rows = {int(r["split"]): r for r in records if _key(r)[:2] == (candidate, dataset)}
    common = sorted(k for k in rows if k in adam and (splits is None or k in splits))
    if not common:
        return None
    diffs = {k: float(rows[k]["test_ll"]) - adam[k] for k in common}
    worst = min(common, key=lambda k: diffs[k])
    return SetScore(
        dataset=dataset,
        candidate=candidate,
        splits=len(common),
        test_ll=sum(float(rows[k]["test_ll"]) for k in common) / len(common),
        adam=sum(adam[k] for k in common) / len(common),
        worst_split=worst,
        worst_difference=diffs[worst],
        cpu_seconds=sum(float(rows[k]["cpu_seconds"]) for k in common) / len(common),
        runs=tuple(
            (
                k,
                float(rows[k]["test_ll"]),
                None if rows[k].get("steps") is None else int(rows[k]["steps"]),
            )
            for k in common
        ),
    )


def stops_no_earlier(a: Settings, b: Settings) -> bool:
    r"""Whether every run under ``a`` stops at the same ELBO step as under ``b`` or later.

    True when both select with :class:`~lightning_dvi.callbacks.PairedEarlyStopping`
    (``selection="paired"``) and differ at most in how long they wait: ``a``'s patience
    :math:`p_a \ge p_b`, its growth :math:`g_a \ge g_b`, and its ``patience_on`` the same or
    ``"kept"`` against ``"best"``. The callback's decision per step (new best, kept) reads only
    the per-row carve-out log-likelihoods, not the patience, so both runs see the same steps and
    decisions up to the earlier stop; the stop comes once the validations without a reset reach
    :math:`\max(p, \lceil g\,b \rceil)` (:math:`b` the best step), which is larger under
    ``a``; and a new best is always kept, so ``"kept"``'s count (reset by every kept step) is
    never above ``"best"``'s (reset by new bests only). Where both stop at the same step they
    restore the same kept step: the same result.
    """
    if a.selection != "paired" or b.selection != "paired":
        return a == b
    on = a.patience_on == b.patience_on or (a.patience_on, b.patience_on) == ("kept", "best")
    same_otherwise = (
        replace(
            a, patience=b.patience, patience_growth=b.patience_growth, patience_on=b.patience_on
        )
        == b
    )
    return (
        same_otherwise
        and on
        and a.patience >= b.patience
        and a.patience_growth >= b.patience_growth
    )


def choose(
    scores: Mapping[str, Mapping[str, SetScore]],
    selection_sets: Sequence[str],
    baseline: str = "today",
    cost_limit: float = 1.5,
    mean_line: float = 0.03,
    split_line: float = 0.3,
    settings: Mapping[str, Settings] | None = None,
) -> str:
    """The candidate chosen on ``selection_sets`` by the module's rule.

    Out: a candidate missing a selection set, or one whose CPU seconds per split exceed
    ``cost_limit`` times the baseline's on any selection set. Ranked by the number of selection
    sets meeting both lines, then by the worst set's mean difference against Adam. Among the
    candidates tied on both, those with the same runs on every selection split
    (:meth:`SetScore.same_runs`) form one group; the group of the lowest mean total CPU time
    wins, and in it the member that :func:`stops_no_earlier` than every other member (else
    its cheapest).

    Args:
        scores: ``scores[candidate][dataset]``; a candidate missing a selection set is out.
        selection_sets: the sets the choice may look at (never the held-out one).
        baseline: the candidate the cost limit is relative to (always eligible).
        cost_limit: the most CPU seconds per split, as a multiple of the baseline's, on any
            selection set.
        mean_line: the most nats a set's mean test LL may trail Adam's and still meet.
        split_line: the most nats any split may trail Adam's on the same split.
        settings: each candidate's runner settings, for :func:`stops_no_earlier` among
            candidates the selection sets cannot tell apart (default :data:`CANDIDATES`; a
            name not in it is compared by CPU time only).
    """
    settings = CANDIDATES if settings is None else settings
    eligible = []
    for name, by_set in scores.items():
        if not all(d in by_set for d in selection_sets):
            continue
        if name != baseline and any(
            by_set[d].cpu_seconds > cost_limit * scores[baseline][d].cpu_seconds
            for d in selection_sets
        ):
            continue
        met = sum(by_set[d].meets(mean_line, split_line) for d in selection_sets)
        worst = min(by_set[d].difference for d in selection_sets)
        eligible.append((-met, -worst, name))
    if not eligible:
        raise ValueError(f"no candidate has results on every selection set {list(selection_sets)}")
    top = min(eligible)[:2]
    tied = sorted(name for *key, name in eligible if tuple(key) == top)
    # candidates with the same runs on every selection split are one for the cost tie-break
    groups: list[list[str]] = []
    for name in tied:
        for group in groups:
            first = scores[group[0]]
            if all(scores[name][d].same_runs(first[d]) for d in selection_sets):
                group.append(name)
                break
        else:
            groups.append([name])

    def cost(name: str) -> float:
        return sum(scores[name][d].cpu_seconds for d in selection_sets)

    group = min(groups, key=lambda g: (sum(cost(n) for n in g) / len(g), g[0]))
    latest = [
        a
        for a in group
        if a in settings
        and all(o in settings and stops_no_earlier(settings[a], settings[o]) for o in group)
    ]
    return latest[0] if latest else min(group, key=lambda n: (cost(n), n))


def leave_one_out(
    records: Sequence[Mapping[str, Any]],
    reference: Mapping[str, Mapping[int, float]],
    held_out_sets: Sequence[str],
    selection_pool: Sequence[str],
    splits: Sequence[int] | None = None,
    **rule: Any,
) -> list[dict[str, Any]]:
    """For each held-out set: the choice on ``selection_pool`` minus that set, and its score there.

    Returns one row per held-out set: ``dataset``, ``chosen``, ``selection_sets``, the chosen
    candidate's :class:`SetScore` fields on the held-out set (``None`` when it was not run
    there) and, for comparison, ``today``'s.
    """
    names = sorted({str(r["candidate"]) for r in records} - {"adam8000"})
    scores: dict[str, dict[str, SetScore]] = {}
    for name in names:
        for dataset in {str(r["dataset"]) for r in records}:
            s = score_set(records, reference, dataset, name, splits)
            if s is not None:
                scores.setdefault(name, {})[dataset] = s
    rows = []
    for held in held_out_sets:
        selection = [d for d in selection_pool if d != held]
        chosen = choose(scores, selection, **rule)
        got = scores.get(chosen, {}).get(held)
        today = scores.get("today", {}).get(held)
        rows.append({
            "dataset": held,
            "chosen": chosen,
            "selection_sets": selection,
            "score": None if got is None else {**asdict(got), "difference": got.difference},
            "today": None if today is None else {**asdict(today), "difference": today.difference},
        })  # fmt: skip
    return rows
