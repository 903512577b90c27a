r"""Leave-one-data-set-out selection of the default regression protocol (issue 45).

Usage::

    python recipes/uci_leave_one_out.py --data-dir ../shared/data/uci \
        --datasets boston,concrete,energy,wine --output loo.jsonl
    python recipes/uci_leave_one_out.py --data-dir ../shared/data/uci --datasets power \
        --output loo.jsonl
    python recipes/uci_leave_one_out.py --data-dir ../shared/data/uci --datasets protein \
        --candidates paired --splits 2 --output loo.jsonl
    python recipes/uci_leave_one_out.py --unseen-dir unseen --datasets diabetes \
        --candidates adam8000,today,paired --output loo.jsonl
    python recipes/uci_leave_one_out.py --output loo.jsonl --report \
        --held-out boston,concrete,energy,power,protein,wine,diabetes \
        --selection-pool boston,concrete,energy,power,wine

Runs every (candidate, data set, split) not yet in ``--output`` (JSON lines, one per split, so
a stopped run resumes), splits ``0 .. --splits - 1`` with ``--seed`` (0), through
:func:`lightning_dvi_benchmarks.uci_leave_one_out.run_grid`. Candidates: the fixed list
:data:`~lightning_dvi_benchmarks.uci_leave_one_out.CANDIDATES`, and ``adam8000`` (the
reference protocol, for sets without figures in ``docs/uci_results.json``). ``--unseen-dir``
writes the regression sets that ship with installed packages
(:data:`~lightning_dvi_benchmarks.uci_unseen.UNSEEN_REGRESSION`: scikit-learn's diabetes) in
the standard layout there first; nothing is downloaded. ``--report`` prints, per held-out set,
the candidate chosen on the others (:func:`~lightning_dvi_benchmarks.uci_leave_one_out.choose`)
and its score there, every split against Adam's, and writes it as JSON with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from lightning_dvi_benchmarks.uci import PRESETS
from lightning_dvi_benchmarks.uci_leave_one_out import (
    CANDIDATES,
    adam_reference,
    leave_one_out,
    load_records,
    run_grid,
)
from lightning_dvi_benchmarks.uci_unseen import UNSEEN_REGRESSION, write_standard_layout

REPO = Path(__file__).resolve().parents[1]


def build_parser() -> argparse.ArgumentParser:
    """The command-line interface (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--data-dir", default=None, help="folder of the shared UCI sets")
    p.add_argument("--unseen-dir", default=None, help="write the bundled unseen sets here")
    p.add_argument("--datasets", default="", help="comma-separated sets to run")
    p.add_argument("--candidates", default=",".join(CANDIDATES), help="comma-separated")
    p.add_argument("--splits", type=int, default=10, help="run splits 0..K-1 (default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output", required=True, help="JSON-lines file (appended to)")
    p.add_argument("--reference", default=str(REPO / "docs" / "uci_results.json"))
    p.add_argument("--report", action="store_true", help="print the leave-one-out table")
    p.add_argument("--held-out", default="boston,concrete,energy,power,protein,wine")
    p.add_argument("--selection-pool", default="boston,concrete,energy,power,wine")
    p.add_argument("--json", default=None, help="write the leave-one-out rows here")
    return p


def _names(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def main(argv: list[str] | None = None) -> int:
    """Run the grid, then report; returns the exit status."""
    args = build_parser().parse_args(argv)
    settings = {**CANDIDATES, "adam8000": PRESETS["adam8000"]}
    unknown = [c for c in _names(args.candidates) if c not in settings]
    if unknown:
        raise SystemExit(f"unknown candidate {unknown[0]!r}; choose from {', '.join(settings)}")
    chosen = {c: settings[c] for c in _names(args.candidates)}
    folders: dict[str, Path] = {}
    if args.unseen_dir is not None:
        for name, table in UNSEEN_REGRESSION.items():
            folder = Path(args.unseen_dir) / name
            if not (folder / "data.txt").is_file():
                write_standard_layout(folder, *table())
            folders[name] = Path(args.unseen_dir)
    for name in _names(args.datasets):
        data_dir = folders.get(name, None if args.data_dir is None else Path(args.data_dir))
        if data_dir is None:
            raise SystemExit(f"{name}: give --data-dir (or --unseen-dir for a bundled set)")

        def report(r: dict) -> None:
            print(f"{r['candidate']:>15s} {r['dataset']:>9s} split {r['split']:2d}: test LL "
                  f"{r['test_ll']:8.4f}  {r['steps']:3d} steps  {r['cpu_seconds']:6.2f} CPU s",
                  flush=True)  # fmt: skip

        run_grid(data_dir, [name], chosen, range(args.splits), args.output, args.seed, report)
    if args.report:
        records = load_records(args.output)
        reference = adam_reference(args.reference, records)
        rows = leave_one_out(records, reference, _names(args.held_out),
                             _names(args.selection_pool), splits=range(args.splits))  # fmt: skip
        for row in rows:
            got, today = row["score"], row["today"]
            line = f"{row['dataset']:>9s}: chosen {row['chosen']:>14s} on {','.join(row['selection_sets'])}"
            if got is None:
                print(line + "  (not run on this set)")
                continue
            print(f"{line}\n{'':11s}test LL {got['test_ll']:.4f} vs Adam {got['adam']:.4f} "
                  f"({got['difference']:+.4f}), worst split {got['worst_split']} "
                  f"({got['worst_difference']:+.3f}), {got['cpu_seconds']:.2f} CPU s/split, "
                  f"{got['splits']} splits"
                  + ("" if today is None else f"; today {today['difference']:+.4f}, worst "
                     f"{today['worst_difference']:+.3f}, {today['cpu_seconds']:.2f} CPU s"))  # fmt: skip
        if args.json is not None:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
