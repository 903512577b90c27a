"""Fast checks of the UCI benchmark: lightning_dvi_benchmarks.uci/tables and the recipe over them."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dvi_benchmarks import uci
from lightning_dvi_benchmarks.tables import markdown_table, summarise

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "uci_benchmark.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("uci_benchmark", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["uci_benchmark"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


@pytest.fixture(autouse=True)
def _short_adam_phase(monkeypatch):
    """Tests of the runner's wiring on toy data: an Adam phase of 10 steps, not the default 300."""
    short = replace(uci.PRESETS["lbfgs"], adam_steps=10)
    monkeypatch.setitem(uci.PRESETS, "lbfgs", short)
    monkeypatch.setattr(uci, "DEFAULTS", short)


def _write_dataset(root: Path, name: str = "toy", rows: int = 60, splits: int = 2) -> Path:
    """A tiny dataset in the standard layout: y = x0 - 2 x1 + noise, in odd units."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    y = 100.0 + 10.0 * (x[:, 0] - 2 * x[:, 1]) + rng.normal(size=rows)
    folder = root / name
    folder.mkdir(parents=True)
    np.savetxt(folder / "data.txt", np.column_stack([x, y]))
    (folder / "index_features.txt").write_text("0\n1\n2\n")
    (folder / "index_target.txt").write_text("3\n")
    for k in range(splits):
        order = rng.permutation(rows)
        np.savetxt(folder / f"index_train_{k}.txt", np.sort(order[:50]), fmt="%d")
        np.savetxt(folder / f"index_test_{k}.txt", np.sort(order[50:]), fmt="%d")
    return folder


def _check_schema(payload: dict, datasets: set[str], methods: set[str], n_splits: int) -> None:
    results = payload["results"]
    assert {(r["dataset"], r["method"]) for r in results} == {
        (d, m) for d in datasets for m in methods
    }
    for r in results:
        assert set(r) >= {
            "dataset", "method", "test_ll_mean", "test_ll_stderr", "rmse_mean",
            "rmse_stderr", "seconds", "splits",
        }  # fmt: skip
        assert len(r["splits"]) == n_splits
        assert [s["split"] for s in r["splits"]] == list(range(n_splits))
        lls = np.array([s["test_ll"] for s in r["splits"]])
        assert all(
            set(s) >= {"split", "test_ll", "rmse", "seconds", "cpu_seconds", "steps"}
            for s in r["splits"]
        )
        assert 0 < r["cpu_seconds_per_split"] < 600
        assert math.isclose(r["test_ll_mean"], lls.mean(), rel_tol=1e-9)
        assert math.isclose(r["test_ll_stderr"], lls.std() / math.sqrt(n_splits), abs_tol=1e-12)
        assert all(math.isfinite(v) for v in (r["test_ll_mean"], r["rmse_mean"], r["seconds"]))
        assert r["rmse_mean"] > 0


def test_unknown_method_and_dataset_are_clear_errors(bench, tmp_path, capsys):
    _write_dataset(tmp_path)
    with pytest.raises(ValueError, match=r"unknown method 'svgd'.*dvi, ddvi, mcvi"):
        bench.parse_args(["--data-dir", str(tmp_path), "--dataset", "toy", "--method", "dvi,svgd"])
    with pytest.raises(ValueError, match=r"unknown dataset 'yacht'.*toy"):
        bench.parse_args(["--data-dir", str(tmp_path), "--dataset", "yacht", "--method", "dvi"])
    with pytest.raises(ValueError, match="has only 2 splits"):
        bench.parse_args(
            ["--data-dir", str(tmp_path), "--dataset", "toy", "--method", "dvi", "--splits", "3"]
        )
    with pytest.raises(ValueError, match="not a directory"):
        bench.parse_args(
            ["--data-dir", str(tmp_path / "nope"), "--dataset", "toy", "--method", "dvi"]
        )
    base = ["--data-dir", str(tmp_path), "--dataset", "toy", "--method", "dvi"]
    with pytest.raises(ValueError, match="--optimizer"):
        bench.parse_args([*base, "--optimizer", "sgd"])
    with pytest.raises(ValueError, match="--precision must be 32-true or 64-true"):
        bench.parse_args([*base, "--precision", "bf16-mixed"])
    with pytest.raises(ValueError, match="--warm-start must be point, adam or none"):
        bench.parse_args([*base, "--warm-start", "map"])
    _, (job, _) = bench.parse_args([*base, "--precision", "64-true", "--adam-steps", "7"])
    assert (job.settings.precision, job.settings.adam_steps) == ("64-true", 7)
    for warm, ramp in (("0.7", "0.4"), ("-0.1", "0.2")):
        with pytest.raises(ValueError, match="fractions of the steps"):
            bench.parse_args([*base, "--kl-warmup", warm, "--kl-anneal", ramp])
    with pytest.raises(ValueError, match="--grad-clip"):
        bench.parse_args([*base, "--grad-clip", "-1"])
    # main() turns them into exit status 2 with the message on stderr
    assert bench.main(["--data-dir", str(tmp_path), "--dataset", "toy", "--method", "svgd"]) == 2
    assert "unknown method 'svgd'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: --method is required
        bench.parse_args(["--data-dir", str(tmp_path), "--dataset", "toy"])


def test_parse_defaults_all_splits_and_width(bench, tmp_path):
    _write_dataset(tmp_path, "toy", splits=3)
    folder = _write_dataset(tmp_path, "wide", splits=2)
    (folder / "n_hidden.txt").write_text("100\n")
    args, jobs = bench.parse_args(
        ["--data-dir", str(tmp_path), "--dataset", "toy,wide", "--method", "dvi,mcvi"]
    )
    assert args.output is None
    assert sorted((j.dataset, j.method, j.split) for j in jobs) == sorted(
        [("toy", m, k) for m in ("dvi", "mcvi") for k in range(3)]
        + [("wide", m, k) for m in ("dvi", "mcvi") for k in range(2)]
    )
    assert {j.dataset: j.hidden for j in jobs} == {"toy": 50, "wide": 100}
    assert all(j.settings == uci.DEFAULTS for j in jobs)
    assert uci.DEFAULTS.optimizer == "lbfgs" and uci.DEFAULTS.early_stopping_fraction > 0
    # the step budget: Adam at least min_steps, at most max_steps, epochs in between
    s = uci.PRESETS["adam8000"]
    assert uci.num_steps(10, s) == s.min_steps == 8000
    assert uci.num_steps(10**7, s) == s.max_steps
    assert uci.num_steps(10, uci.DEFAULTS) == uci.DEFAULTS.max_steps  # L-BFGS: a cap, ES decides
    # MCVI cannot use L-BFGS: its jobs run the Adam protocol
    mcvi = next(j for j in jobs if j.method == "mcvi")
    assert mcvi.effective_settings.optimizer == "adam"
    _, (old,) = bench.parse_args(["--data-dir", str(tmp_path), "--dataset", "toy", "--method",
                                  "dvi", "--splits", "1", "--preset", "adam8000", "--lr", "0.01"])  # fmt: skip
    assert old.settings == replace(uci.PRESETS["adam8000"], lr=0.01)


def test_paper_reference_covers_every_method():
    assert set(uci.PAPER) == set(uci.METHODS)
    for figures in uci.PAPER.values():
        assert {"boston", "concrete", "energy", "power", "protein", "wine"} <= set(figures)
    assert uci.PAPER["dvi"]["boston"] == (-2.41, 0.02)
    assert uci.PAPER["dvi-fixed"]["wine"] == (-0.94, 0.01)


def test_summary_and_table_by_hand():
    splits = [
        {"split": 1, "test_ll": -2.0, "rmse": 3.0, "seconds": 2.0, "cpu_seconds": 1.0, "steps": 5},
        {"split": 0, "test_ll": -1.0, "rmse": 1.0, "seconds": 4.0, "cpu_seconds": 2.0, "steps": 7},
    ]
    row = summarise("boston", "dvi", splits)
    assert [s["split"] for s in row["splits"]] == [0, 1]
    assert row["test_ll_mean"] == -1.5 and row["test_ll_stderr"] == pytest.approx(0.5 / 2**0.5)
    assert row["rmse_mean"] == 2.0 and row["seconds"] == 6.0
    assert row["cpu_seconds_per_split"] == 1.5
    table = markdown_table([row], uci.PAPER).splitlines()
    assert table[0].endswith("| CPU s / split |")
    assert table[2] == "| boston | dvi | 2 | -1.500 ± 0.354 | -2.41 ± 0.02 | 2.000 ± 0.707 | 1.50 |"
    no_cpu = summarise("toy", "dvi", [{k: v for k, v in splits[0].items() if k != "cpu_seconds"}])
    assert no_cpu["cpu_seconds_per_split"] is None
    assert markdown_table([no_cpu]).splitlines()[2].endswith("| n/a | 3.000 ± 0.000 | n/a |")
    with pytest.raises(ValueError, match="no splits"):
        summarise("toy", "dvi", [])


def test_synthetic_end_to_end_all_methods(bench, tmp_path, capsys):
    _write_dataset(tmp_path)
    out = tmp_path / "results.json"
    methods = list(bench.METHODS)
    code = bench.main(
        [
            "--data-dir",
            str(tmp_path),
            "--dataset",
            "toy",
            "--method",
            ",".join(methods),
            "--splits",
            "1",
            "--max-steps",
            "15",
            "--workers",
            "1",
            "--mc-eval-samples",
            "7",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    payload = json.loads(out.read_text())
    _check_schema(payload, {"toy"}, set(methods), 1)
    assert all(1 <= r["splits"][0]["steps"] <= 15 for r in payload["results"])
    table = capsys.readouterr().out
    assert "| toy | dvi | 1 |" in table and "n/a" in table  # no paper figure for a new dataset


def test_seeded_runs_are_reproducible(bench, tmp_path):
    _write_dataset(tmp_path)
    argv = ["--data-dir", str(tmp_path), "--dataset", "toy", "--method", "dvi", "--splits", "1",
            "--max-steps", "10"]  # fmt: skip
    _, jobs = bench.parse_args(argv)
    first, second = uci.run_job(jobs[0]), uci.run_job(jobs[0])
    assert first["test_ll"] == second["test_ll"] and first["rmse"] == second["rmse"]


def test_validation_mode_scores_a_carve_out_of_the_training_split(bench, tmp_path):
    _write_dataset(tmp_path)
    argv = ["--data-dir", str(tmp_path), "--dataset", "toy", "--method", "dvi", "--splits", "1",
            "--max-steps", "10"]  # fmt: skip
    _, (test_job,) = bench.parse_args(argv)
    _, (val_job,) = bench.parse_args([*argv, "--validation", "0.2"])
    assert val_job.validation == 0.2
    assert uci.run_job(test_job)["test_ll"] != uci.run_job(val_job)["test_ll"]


def test_early_stopping_restores_the_best_validation_step(tmp_path):
    """The default protocol stops on the carve-out's NLL and keeps the best step's weights."""
    _write_dataset(tmp_path, rows=120)
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], replace(uci.DEFAULTS, patience=2), 1)
    result = uci.run_job(job)
    assert 1 <= result["steps"] < uci.DEFAULTS.max_steps
    assert math.isfinite(result["test_ll"]) and result["cpu_seconds"] > 0


def test_the_adam_warm_start_runs_on_small_training_sets_only(tmp_path):
    """``warm_start="adam"``: ``adam_steps`` full-batch Adam steps, then L-BFGS; above ``adam_max_rows``, none."""
    _write_dataset(tmp_path, rows=120)
    small = replace(uci.PRESETS["lbfgs-adam"], adam_steps=6, patience=2, max_steps=5)
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], small, 1)
    warmed = uci.run_job(job)
    assert warmed["adam_steps"] == 6 and 1 <= warmed["steps"] <= 5
    assert warmed["warm_start_steps"] == 0
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], replace(small, adam_max_rows=10), 1)
    direct = uci.run_job(job)
    assert direct["adam_steps"] == 0 and direct["test_ll"] != warmed["test_ll"]
    assert all(math.isfinite(r["test_ll"]) for r in (warmed, direct))


def test_the_default_protocol_warm_starts_with_a_point_estimate(tmp_path):
    """``warm_start="point"`` (the default): the means' L-BFGS fit runs inside the Trainer, no Adam."""
    _write_dataset(tmp_path, rows=120)
    settings = replace(uci.DEFAULTS, patience=2, max_steps=5)
    assert settings.warm_start == "point"
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], settings, 1)
    warmed = uci.run_job(job)
    assert warmed["adam_steps"] == 0 and warmed["warm_start_steps"] >= 1
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], replace(settings, warm_start="none"), 1)
    cold = uci.run_job(job)
    assert cold["warm_start_steps"] == 0 and cold["adam_steps"] == 0
    # y = x0 - 2 x1 + noise: five ELBO steps from the fitted means beat five from the prior
    assert warmed["rmse"] < cold["rmse"]


def _large(**changes) -> uci.Settings:
    """The default protocol with the large-table rule scaled to the toy set (45 training rows)."""
    base = dict(large_rows=20, large_subsample=16, large_subsample_steps=3, large_batch_size=8,
                large_epochs=2.0, patience=2, max_steps=4)  # fmt: skip
    return replace(uci.DEFAULTS, **{**base, **changes})


def test_large_tables_take_the_subsample_then_minibatch_protocol(tmp_path, monkeypatch):
    """Above ``large_rows``: warm start and L-BFGS on the subsample, then mini-batch Adam epochs.

    Every model of the run weighs its KL against the full training set (``num_data`` = 45),
    also the one fitted on the 16-row subsample.
    """
    import lightning_dvi.lightning as front

    built: list[tuple[int, str]] = []

    class Recording(front.DVIRegressor):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append((self.num_data, self.optimiser_config.optimizer))

    monkeypatch.setattr(front, "DVIRegressor", Recording)
    _write_dataset(tmp_path, rows=120)
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], _large(), 1)
    result = uci.run_job(job)
    assert result["protocol"] == "large"
    assert 1 <= result["steps"] <= 3 and result["warm_start_steps"] >= 1
    assert result["adam_steps"] == 2 * math.ceil(45 / 8)  # two epochs of 8-row batches
    assert result["kept_step"] is not None and 0 <= result["kept_step"] < result["steps"]
    assert math.isfinite(result["test_ll"]) and result["rmse"] > 0
    assert built == [(45, "lbfgs"), (45, "adam")]


def test_the_large_table_rule_reads_the_training_rows_only(tmp_path):
    """At or below ``large_rows`` the run is the full-batch protocol's, number for number."""
    _write_dataset(tmp_path, rows=120)
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], _large(large_rows=45), 1)
    at_limit = uci.run_job(job)
    full = replace(uci.PRESETS["lbfgs-full-batch"], patience=2, max_steps=4)
    assert full.large_rows == 0
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], full, 1)
    reference = uci.run_job(job)
    assert at_limit["protocol"] == reference["protocol"] == "full-batch"
    for key in ("test_ll", "rmse", "steps", "warm_start_steps", "kept_step"):
        assert at_limit[key] == reference[key]
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], _large(large_rows=44), 1)
    assert uci.run_job(job)["protocol"] == "large"


def test_the_subsample_is_seeded_training_rows_with_the_full_statistics(tmp_path):
    from lightning_dvi.data import UCIDataModule

    _write_dataset(tmp_path, rows=120)
    dm = UCIDataModule(str(tmp_path), "toy", split=0, val_fraction=0.1, batch_size=45, seed=0)
    rows = uci._train_rows(dm, 16, seed=3)
    (x, y), full = next(iter(rows.train_dataloader())), dm.train_dataset.tensors
    assert x.shape == (16, 3) and y.shape == (16,)
    # distinct training rows, each one of the full set's
    matches = (x[:, None, :] == full[0][None, :, :]).all(-1)
    assert (matches.sum(1) == 1).all() and len(set(matches.int().argmax(1).tolist())) == 16
    assert torch.equal(y, full[1][matches.int().argmax(1)])
    assert (rows.target_loc, rows.target_scale) == (dm.target_loc, dm.target_scale)
    assert rows.test_dataset is dm.test_dataset
    (vx, _), (dx, _) = next(iter(rows.val_dataloader())), next(iter(dm.val_dataloader()))
    assert torch.equal(vx, dx)
    again = next(iter(uci._train_rows(dm, 16, seed=3).train_dataloader()))[0]
    other = next(iter(uci._train_rows(dm, 16, seed=4).train_dataloader()))[0]
    assert torch.equal(again, x) and not torch.equal(other, x)
    everything = next(iter(uci._train_rows(dm, 1000, seed=3).train_dataloader()))[0]
    assert torch.equal(everything, full[0])


def test_float64_training_through_the_runner(tmp_path):
    _write_dataset(tmp_path, rows=120)
    settings = replace(uci.DEFAULTS, adam_steps=4, max_steps=3, precision="64-true")
    (job,) = uci.make_jobs(tmp_path, ["toy"], ["dvi"], settings, 1)
    assert math.isfinite(uci.run_job(job)["test_ll"])


def test_boston_one_split_through_the_real_path(bench, uci_dir, tmp_path):
    out = tmp_path / "boston.json"
    code = bench.main(
        [
            "--data-dir",
            str(uci_dir),
            "--dataset",
            "boston",
            "--method",
            "dvi",
            "--splits",
            "1",
            "--max-steps",
            "200",
            "--workers",
            "1",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    payload = json.loads(out.read_text())
    _check_schema(payload, {"boston"}, {"dvi"}, 1)
    (result,) = payload["results"]
    # Original units: boston prices are in $1000s, so a sane model has RMSE of a few units and a
    # log-likelihood near -2.5 (standardised-unit numbers would be near -1 and RMSE < 1).
    assert 2.0 < result["rmse_mean"] < 8.0
    assert -4.0 < result["test_ll_mean"] < -2.0


def test_time_to_quality_curve_and_plot(tmp_path):
    """recipes/uci_time_to_quality.py: one point per budget and protocol, a PNG written."""
    spec = importlib.util.spec_from_file_location(
        "uci_time_to_quality", RECIPE.parent / "uci_time_to_quality.py"
    )
    ttq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ttq)
    _write_dataset(tmp_path)
    out, png = tmp_path / "ttq.json", tmp_path / "ttq.png"
    argv = ["--data-dir", str(tmp_path), "--dataset", "toy", "--splits", "1", "--workers", "1",
            "--adam-steps", "3", "--lbfgs-steps", "1", "--json", str(out), "--plot", str(png)]  # fmt: skip
    assert ttq.main(argv) == 0
    points = json.loads(out.read_text())
    assert [p["steps_cap"] for p in points["adam8000"]] == [3]
    for preset in ("lbfgs", "lbfgs-adam"):
        assert [p["steps_cap"] for p in points[preset]] == [1, None]
        assert points[preset][0]["steps"] == [1]
    assert all(
        p["cpu_seconds"] > 0 and math.isfinite(p["test_ll"]) for v in points.values() for p in v
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
