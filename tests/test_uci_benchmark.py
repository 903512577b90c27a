"""Fast checks of recipes/uci_benchmark.py: CLI validation, JSON schema, the real training path."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "uci_benchmark.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("uci_benchmark", RECIPE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["uci_benchmark"] = module  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(module)
    return module


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
        assert all(set(s) >= {"split", "test_ll", "rmse", "seconds"} for s in r["splits"])
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
    assert all(j.settings == bench.DEFAULTS for j in jobs)
    # the step budget: at least min_steps, at most max_steps, epochs in between
    s = bench.DEFAULTS
    assert bench.num_steps(10, s) == s.min_steps
    assert bench.num_steps(10**7, s) == s.max_steps


def test_paper_reference_covers_every_method(bench):
    assert set(bench.PAPER) == set(bench.METHODS)
    for figures in bench.PAPER.values():
        assert {"boston", "concrete", "energy", "power", "protein", "wine"} <= set(figures)
    assert bench.PAPER["dvi"]["boston"] == (-2.41, 0.02)
    assert bench.PAPER["dvi-fixed"]["wine"] == (-0.94, 0.01)


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
    assert all(r["splits"][0]["steps"] == 15 for r in payload["results"])
    table = capsys.readouterr().out
    assert "| toy | dvi | 1 |" in table and "n/a" in table  # no paper figure for a new dataset


def test_seeded_runs_are_reproducible(bench, tmp_path):
    _write_dataset(tmp_path)
    argv = ["--data-dir", str(tmp_path), "--dataset", "toy", "--method", "dvi", "--splits", "1",
            "--max-steps", "10"]  # fmt: skip
    _, jobs = bench.parse_args(argv)
    first, second = bench.run_job(jobs[0]), bench.run_job(jobs[0])
    assert first["test_ll"] == second["test_ll"] and first["rmse"] == second["rmse"]


def test_validation_mode_scores_a_carve_out_of_the_training_split(bench, tmp_path):
    _write_dataset(tmp_path)
    argv = ["--data-dir", str(tmp_path), "--dataset", "toy", "--method", "dvi", "--splits", "1",
            "--max-steps", "10"]  # fmt: skip
    _, (test_job,) = bench.parse_args(argv)
    _, (val_job,) = bench.parse_args([*argv, "--validation", "0.2"])
    assert val_job.validation == 0.2
    assert bench.run_job(test_job)["test_ll"] != bench.run_job(val_job)["test_ll"]


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
