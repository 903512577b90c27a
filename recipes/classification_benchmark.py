r"""Digits (and synthetic) classification: DVIClassifier's defaults next to plain, ensemble, dropout, Laplace.

Usage::

    python recipes/classification_benchmark.py --protocol mlp [--seeds 3] [--rows plain,defaults]
        [--epochs N] [--json results.json] [--interleave]

Every row of a protocol trains on the same split with the same budget (Adam, learning rate,
batch 128, epochs; the weights of the epoch with the lowest validation NLL) and reports mean ±
standard deviation over seeds (initialisation and batch order; the split is fixed) of test
accuracy, NLL, ECE (15 bins), Brier score, OOD AUROC of the predictive entropy (and of the
mutual information for rows with samples) against feature-permuted test digits, and the CPU
seconds of training. The machinery is :mod:`lightning_dvi_benchmarks.classification`.

Protocols (``--protocol``):

* ``mlp``: digits standardised per pixel, 1257 / 180 / 360 rows, MLP 100-100, Adam 3e-3,
  60 epochs (issue 26's new-user run);
* ``scaled``: the same split with pixels divided by 16 (the 70/10/20 benchmark);
* ``cnn``: digits images standardised globally, :class:`lightning_dvi.nn.CNN` (conv 16, 32,
  dense 64) and its plain twin, Adam 3e-3, 60 epochs;
* ``defaults``: the defaults against a plain network and the old defaults over widths 50-400,
  depths 1-3, 200 training rows and a 50 000-row synthetic problem (``lightning_dvi_benchmarks``
  ``.data.synthetic_split``, 10 epochs);
* ``unseen`` (issue 41, item 4): ``DVIClassifier()``'s defaults (``true_defaults``, 128-128)
  against a plain 128-128 MLP (``plain_128``) on the sets of
  ``lightning_dvi_benchmarks.data.UNSEEN_SETS`` (``--sets``, default all: ten overlapping
  classes with label noise, heavily corrupted digits, labels from a random teacher network),
  Adam 3e-3, 60 epochs, with the ECE noise floor in the table; ``--plots DIR`` writes one
  reliability diagram per set (``classification_unseen_<set>.png``, every seed's test rows
  pooled). The teacher set also gets a ``bayes`` row: its generating probabilities.

``--folds K`` (``mlp``, ``scaled``, ``cnn``): instead of the one split, train every row on
each of ``K`` stratified folds of all 1797 digits and score the pooled out-of-fold
predictions (``lightning_dvi_benchmarks.classification.run_row_pooled``), with the ECE a
perfectly calibrated model would score on as many rows (``ece_floor``).
"""

from __future__ import annotations

import argparse
import functools
import json
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_dvi.metrics import classification_summary, ece_noise_floor
from lightning_dvi_benchmarks.classification import (
    METRICS,
    POOLED_METRICS,
    Row,
    markdown_table,
    run_row,
    run_row_pooled,
)
from lightning_dvi_benchmarks.data import (
    UNSEEN_SETS,
    Budget,
    ClassificationSplit,
    digits_folds,
    digits_split,
    synthetic_split,
)

# DVIClassifier's defaults before issues 23 and 26 (the predictive is today's)
OLD_DEFAULTS = {
    "mode": "full", "prior": "empirical_bayes", "kl_weight": 1.0, "likelihood_method": "clark",
}  # fmt: skip
# DVIClassifier's defaults until the untempered ELBO under N(0, 0.1) replaced them (issue 41)
TEMPERED = {"kl_weight": 0.1, "prior_variance": 1.0}
# the candidates of the ``selected`` row (``lightning_dvi_benchmarks.classification``
# ``.fit_dvi_selected``): DVIClassifier()'s defaults (the untempered ELBO, N(0, 0.1)) and the
# earlier defaults (kl_weight 0.1, N(0, 1))
SELECT_CANDIDATES = ({}, TEMPERED)
# the ``selected`` row's candidates alone, each with DVIClassifier's own calibrate=True choice
# (derived from the same fits: ``details["own_choice"]``); "cal:defaults" is DVIClassifier()
CANDIDATE_NAMES = ("cal:defaults", "cal:kl0.1_prior1")
MFVI = {  # N(0, 1), KL 1
    "mode": "local", "prior": "gaussian", "prior_variance": 1.0, "num_samples": 1, "kl_weight": 1.0,
}  # fmt: skip
ROWS = {
    "plain": Row("plain"),
    "plain_wd": Row("plain_tuned"),  # weight decay in {0, 1e-4, 1e-3, 1e-2} on validation
    "ensemble": Row("ensemble"),  # five plain networks
    "mc_dropout": Row("mc_dropout"),  # rate in {0.05, 0.1, 0.2} on validation
    "laplace": Row("laplace"),  # last layer, on plain_wd, prior precision on validation
    "mfvi": Row("dvi", settings=MFVI),
    "defaults": Row("dvi"),  # DVIClassifier's defaults, the protocol's architecture and lr
    # the untempered ELBO under N(0, 1) (the defaults' kl_weight with the earlier prior)
    "elbo": Row("dvi", settings={"kl_weight": 1.0, "prior_variance": 1.0}),
    "tempered": Row("dvi", settings=TEMPERED),  # the earlier defaults, the protocol's network
    "tempered_128": Row("dvi", hidden=(128, 128), settings=TEMPERED),  # ... DVIClassifier()'s
    "old_defaults": Row("dvi", settings=OLD_DEFAULTS),
    "true_defaults": Row("dvi", hidden=(128, 128)),  # DVIClassifier(): [128, 128], lr 3e-3
    "plain_128": Row("plain", hidden=(128, 128)),  # a plain network of that shape
    "true_defaults_64": Row(
        "dvi", hidden=(64,), settings={"lr": 3e-3}
    ),  # DVIClassifier() until [128, 128]
    "true_defaults_lr1e-3": Row("dvi", hidden=(64,), settings={"lr": 1e-3}),  # before the lr
    "plain_64": Row("plain", hidden=(64,)),
    # issue 41 item 4: per run, the defaults or the earlier, tempered defaults,
    # each as trained and with its post-hoc variants (a factor on the posterior stds, a
    # temperature, a temperature with a uniform floor, fitted on the validation NLL:
    # lightning_dvi.lightning.temperature.select_classifier); the defaults as trained unless
    # a variant beats them by 2 paired standard errors
    "selected": Row("dvi_select", hidden=(128, 128), settings={"candidates": SELECT_CANDIDATES}),
    "plain_wd_128": Row("plain_tuned", hidden=(128, 128)),  # plain_wd of DVIClassifier()'s shape
}
# rows with their own network (DVIClassifier()'s and the plain twins), whatever the protocol's
FIXED_SHAPE = (
    "true_defaults", "plain_128", "true_defaults_64", "true_defaults_lr1e-3", "plain_64",
    "selected", "plain_wd_128", "tempered_128",
)  # fmt: skip
PROTOCOLS = {
    "mlp": (lambda: digits_split("standardized"), Budget(), "mlp", list(ROWS)),
    "scaled": (lambda: digits_split("scaled"), Budget(), "mlp", list(ROWS)),
    "cnn": (
        lambda: digits_split("global", images=True), Budget(), "cnn",
        ["plain", "plain_wd", "ensemble", "mfvi", "defaults", "elbo", "old_defaults"],
    ),
}  # fmt: skip
# --folds: each protocol's preprocessing and input layout
FOLDS = {
    "mlp": lambda k: digits_folds("standardized", folds=k),
    "scaled": lambda k: digits_folds("scaled", folds=k),
    "cnn": lambda k: digits_folds("global", folds=k, images=True),
}
# (case, split, hidden, budget) of the ``defaults`` protocol
SWEEP = [
    ("width 50", lambda: digits_split("standardized"), (50, 50), Budget()),
    ("width 400", lambda: digits_split("standardized"), (400, 400), Budget()),
    ("depth 1", lambda: digits_split("standardized"), (100,), Budget()),
    ("depth 3", lambda: digits_split("standardized"), (100, 100, 100), Budget()),
    ("200 rows", lambda: digits_split("standardized", num_train=200), (100, 100), Budget()),
    ("50 000 rows", lambda: synthetic_split(50_000), (100, 100), Budget(epochs=10)),
]

# the ``unseen`` protocol: its rows and table columns
UNSEEN_ROWS = ["plain_128", "true_defaults", "selected"]
UNSEEN_METRICS = ("acc", "nll", "ece", "ece_floor", "confidence", "brier", "train_s")


def _bayes_run(split: ClassificationSplit) -> dict[str, Any]:
    """The generating probabilities of a split's test labels, scored like a trained row."""
    assert split.test_probs is not None
    probs = split.test_probs
    out: dict[str, Any] = classification_summary(probs, split.y_test)
    out.update(confidence=float(probs.max(-1).values.mean()), ece_floor=ece_noise_floor(probs))
    return {**out, "train_s": 0.0}


def reliability_plot(runs: dict[str, list[dict]], title: str, path: Path) -> None:
    """One reliability panel per row, its seeds' test rows pooled into the 15 bins.

    Bars: the accuracy per confidence bin; dots: the bin's mean confidence; the diagonal is
    calibration (a bar below it is over-confident). The panel title gives the mean over the
    runs of each run's ECE and of its noise floor (the table's figures); the bottom strip, the
    rows per bin.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4 * len(runs), 4.6))
    FigureCanvasAgg(fig)
    grid = fig.add_gridspec(2, len(runs), height_ratios=[3, 1])
    for col, (name, row_runs) in enumerate(runs.items()):
        bins = [run["reliability"] for run in row_runs]
        edges = np.array(bins[0]["bin_edges"])
        count = sum(np.array(b["count"]) for b in bins)
        hits = sum(np.array(b["count"]) * np.array(b["accuracy"]) for b in bins)
        conf = sum(np.array(b["count"]) * np.array(b["confidence"]) for b in bins)
        safe = np.maximum(count, 1)
        ece = float(np.mean([run["ece"] for run in row_runs]))
        floor = float(np.mean([run["ece_floor"] for run in row_runs]))
        width, filled = np.diff(edges), count > 0
        ax = fig.add_subplot(grid[0, col])
        ax.plot([0, 1], [0, 1], "k--", lw=1, label="calibrated")
        ax.bar(edges[:-1], hits / safe, width=width, align="edge", color="C0", edgecolor="k",
               alpha=0.7, label="accuracy")  # fmt: skip
        ax.scatter(edges[:-1][filled] + width[filled] / 2, (conf / safe)[filled], c="C3", s=12,
                   zorder=3, label="mean confidence")  # fmt: skip
        ax.set(xlim=(0, 1), ylim=(0, 1), ylabel="accuracy" if col == 0 else None)
        ax.set_title(
            f"{name}\nECE {ece:.3f} (floor {floor:.3f}), {len(row_runs)} seeds", fontsize=9
        )
        ax.legend(loc="upper left", fontsize=7)
        strip = fig.add_subplot(grid[1, col], sharex=ax)
        strip.bar(edges[:-1], count, width=width, align="edge", color="0.5")
        strip.set(xlabel="confidence", ylabel="rows" if col == 0 else None)
    fig.suptitle(title, fontsize=10, y=1.04)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")


def _is_dvi(key: str) -> bool:
    """Whether a result key (``"<row>[ <settings>] (<set>)"``) names a DVI row."""
    if key.startswith("cal:"):
        return True
    row = ROWS.get(key.split(" ", 1)[0])
    return row is not None and row.kind in ("dvi", "dvi_select")


def derive_candidates(results: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Each ``selected`` candidate alone with ``calibrate=True``, from the same fits.

    Per run, ``details["own_choice"][m]`` is the variant
    ``lightning_dvi.lightning.temperature.calibrate_classifier`` keeps for candidate ``m`` on
    its own (the gate against its own trained predictive), and ``details["variant_test"]``
    that variant's test metrics: what ``DVIClassifier(**candidate)`` (``calibrate=True``, the
    default) gives after the same training. Keys ``"cal:<candidate> (<set>)"`` (no set in
    the digits protocols).
    """
    derived: dict[str, list[dict]] = {}
    for key, runs in results.items():
        if not key.startswith("selected"):
            continue
        case = key[key.rindex(" (") :] if " (" in key else ""
        for run in runs:
            details = run.get("details", {})
            for m, index in enumerate(details.get("own_choice", [])):
                name = CANDIDATE_NAMES[m] if m < len(CANDIDATE_NAMES) else f"cal:candidate{m}"
                test = details["variant_test"][index]
                variant = details["variants"][index]
                derived.setdefault(f"{name}{case}", []).append(
                    {**{k: test[k] for k in ("acc", "nll", "ece", "ece_floor", "confidence")},
                     "brier": float("nan"), "train_s": float("nan"), "kind": variant["kind"],
                     "scale": variant["scale"], "temperature": variant["temperature"],
                     "floor": variant["floor"]}
                )  # fmt: skip
    return derived


def unseen_report(results: dict[str, list[dict]], sets: list[str]) -> str:
    """Per-seed rows and issue 41's acceptance for every DVI row against ``plain_128``, per set.

    Acceptance, on the means over the seeds: accuracy at least the plain network's minus
    0.01, NLL below the plain network's, and ECE at most the plain network's or at most the
    DVI row's own noise floor (indistinguishable from a calibrated model on these rows).
    """
    lines = ["| set | seed | row | acc | NLL | ECE | ECE floor | confidence |", "|---" * 8 + "|"]
    verdicts = [
        "| set | DVI row | acc − plain | NLL − plain | ECE − plain | ECE floor (DVI) | met |",
        "|---" * 7 + "|",
    ]
    for case in sets:
        plain = results.get(f"plain_128 ({case})")
        dvi = [key for key in results if key.endswith(f" ({case})") and _is_dvi(key)]
        for key in [f"plain_128 ({case})", *dvi]:
            for seed, run in enumerate(results.get(key, [])):
                lines.append(
                    f"| {case} | {seed} | {key.removesuffix(f' ({case})')} | {run['acc']:.3f} | "
                    f"{run['nll']:.3f} | {run['ece']:.3f} | {run['ece_floor']:.3f} | "
                    f"{run['confidence']:.3f} |"
                )
        if plain is None:
            continue
        base = {k: float(np.mean([run[k] for run in plain])) for k in ("acc", "nll", "ece")}
        for key in dvi:
            mean = {
                k: float(np.mean([run[k] for run in results[key]]))
                for k in ("acc", "nll", "ece", "ece_floor")
            }
            checks = (
                mean["acc"] >= base["acc"] - 0.01,
                mean["nll"] < base["nll"],
                mean["ece"] <= base["ece"] or mean["ece"] <= mean["ece_floor"],
            )
            met = "yes" if all(checks) else "no (" + ", ".join(
                name for name, ok in zip(("acc", "NLL", "ECE"), checks, strict=True) if not ok
            ) + ")"  # fmt: skip
            verdicts.append(
                f"| {case} | {key.removesuffix(f' ({case})')} | {mean['acc'] - base['acc']:+.3f} | "
                f"{mean['nll'] - base['nll']:+.3f} | {mean['ece'] - base['ece']:+.3f} | "
                f"{mean['ece_floor']:.3f} | {met} |"
            )
    return "\n".join([*lines, "", *verdicts])


def _row(name: str, arch: str, hidden: tuple[int, ...]) -> Row:
    """The named row on the protocol's architecture (the true defaults keep their own shape)."""
    row = ROWS[name]
    if name in FIXED_SHAPE:
        return row
    return Row(row.kind, arch, hidden, row.settings)  # type: ignore[arg-type]  # arch: a PROTOCOLS literal


def _replay(path: str, sets: list[str], plots: str | None) -> None:
    """Print the ``unseen`` tables of a saved run and, with ``plots``, redraw its diagrams."""
    results = json.loads(Path(path).read_text())["results"]
    results.update(derive_candidates(results))
    print(markdown_table(results, UNSEEN_METRICS))
    print(f"\n{unseen_report(results, sets)}")
    for case in sets if plots else []:
        runs = {
            k: v
            for k, v in results.items()
            if k.endswith(f" ({case})") and "bayes" not in k and not k.startswith("cal:")
        }
        title = f"{UNSEEN_SETS[case]().name}: test reliability"
        reliability_plot(runs, title, Path(plots) / f"classification_unseen_{case}.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--protocol", choices=[*PROTOCOLS, "defaults", "unseen"], default="mlp")
    parser.add_argument(
        "--sets",
        default=None,
        help=f"unseen: comma-separated sets (default: {','.join(UNSEEN_SETS)})",
    )
    parser.add_argument("--plots", default=None, help="unseen: write reliability PNGs here")
    parser.add_argument(
        "--replay",
        default=None,
        help="unseen: print the tables (and with --plots draw the diagrams) of a saved --json run",
    )
    parser.add_argument(
        "--dvi-settings",
        default=None,
        help="JSON DVIClassifier arguments added to every DVI row, e.g. '{\"kl_weight\": 1.0}' "
        "(the row names get the JSON appended)",
    )
    parser.add_argument("--rows", default=None, help="comma-separated rows (default: all)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per row")
    parser.add_argument("--epochs", type=int, default=None, help="override the budget's epochs")
    parser.add_argument("--json", default=None, help="write every run here")
    parser.add_argument(
        "--folds",
        type=int,
        default=None,
        help="score pooled out-of-fold predictions over K folds of all digits (not 'defaults')",
    )
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="run the rows seed by seed, alternating their order (for CPU-time comparisons)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", ".*does not have many workers.*|.*LeafSpec.*")
    if args.protocol == "defaults":
        cases = [(name, make, hidden, budget, "mlp") for name, make, hidden, budget in SWEEP]
        names = args.rows.split(",") if args.rows else ["plain", "defaults", "old_defaults"]
    elif args.protocol == "unseen":
        sets = args.sets.split(",") if args.sets else list(UNSEEN_SETS)
        if any(name not in UNSEEN_SETS for name in sets):
            parser.error(f"unknown sets in {sets} (known: {list(UNSEEN_SETS)})")
        if args.replay:
            _replay(args.replay, sets, args.plots)
            return
        cases = [(name, UNSEEN_SETS[name], (100, 100), Budget(), "mlp") for name in sets]
        names = args.rows.split(",") if args.rows else UNSEEN_ROWS
    else:
        make, budget, arch, names = PROTOCOLS[args.protocol]
        hidden = (64,) if arch == "cnn" else (100, 100)
        cases = [(args.protocol, make, hidden, budget, arch)]
        names = args.rows.split(",") if args.rows else names
    unknown = [name for name in names if name not in ROWS]
    if unknown or args.seeds < 1:
        parser.error(f"unknown rows {unknown} (known: {list(ROWS)}) or --seeds < 1")
    if args.folds is not None and (
        args.protocol in ("defaults", "unseen") or args.folds < 2 or args.interleave
    ):
        parser.error("--folds needs K >= 2, a digits protocol and no --interleave")
    results: dict[str, list[dict]] = {}
    for case, make, hidden, budget, arch in cases:
        if args.epochs:
            budget = Budget(args.epochs, budget.lr, budget.batch_size)
        # --folds: every row on each fold, scored on the pooled out-of-fold predictions
        data = FOLDS[args.protocol](args.folds) if args.folds else make()
        train = functools.partial(run_row_pooled if args.folds else run_row, data)
        rows = {name: _row(name, arch, hidden) for name in names}
        several = args.protocol in ("defaults", "unseen")
        keys = {name: f"{name} ({case})" if several else name for name in names}
        if args.dvi_settings:  # the same extra arguments on every DVI row
            extra = json.loads(args.dvi_settings)
            for name, row in rows.items():
                if row.kind == "dvi":
                    rows[name] = Row("dvi", row.arch, row.hidden, {**row.settings, **extra})
                    keys[name] = f"{name} {args.dvi_settings}" + (f" ({case})" if several else "")
                elif row.kind == "dvi_select":  # on every candidate
                    chosen = [{**c, **extra} for c in row.settings["candidates"]]
                    rows[name] = Row(row.kind, row.arch, row.hidden, {"candidates": chosen})
                    keys[name] = f"{name} {args.dvi_settings}" + (f" ({case})" if several else "")
        if args.interleave:  # seed by seed, the rows' order reversed every other seed
            for seed in range(args.seeds):
                for name in names if seed % 2 == 0 else names[::-1]:
                    run = train(rows[name], budget, seed)
                    results.setdefault(keys[name], []).append(run)
                    print(f"{case} {name} seed {seed}: {run['train_s']:.2f} CPU s", flush=True)
            continue
        for name in names:
            results[keys[name]] = [train(rows[name], budget, s) for s in range(args.seeds)]
            print(f"{case} {name}: done", flush=True)
        if args.protocol == "unseen" and data.test_probs is not None:
            results[f"bayes ({case})"] = [_bayes_run(data)] * args.seeds
        if args.plots and args.protocol == "unseen":
            runs = {keys[name]: results[keys[name]] for name in names}
            path = Path(args.plots) / f"classification_unseen_{case}.png"
            reliability_plot(runs, f"{data.name}: test reliability", path)
            print(f"wrote {path}", flush=True)
    if args.folds is None:
        results.update(derive_candidates(results))
    title = f"{args.protocol}, {args.folds} folds pooled" if args.folds else args.protocol
    keys_ = UNSEEN_METRICS if args.protocol == "unseen" else METRICS
    table = markdown_table(results, POOLED_METRICS if args.folds else keys_)
    print(f"\n{title}: {args.seeds} seed(s)\n{table}")
    if args.protocol == "unseen":
        print(f"\n{unseen_report(results, [case for case, *_ in cases])}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "results": results}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
