"""The CLI on a user's own files, as a user runs it (issue 44, items 4 and 8): a label seen only
in the test file, the summary's heading per task, the files ``predict`` lists, a resume whose
``max_epochs`` the checkpoint has already passed, and a file separated by another delimiter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_dvi.cli import cli

REPO = Path(__file__).resolve().parents[1]
CLASSIFICATION = REPO / "recipes" / "csv_classification.yaml"


pytestmark = pytest.mark.usefixtures("cli_isolated")


def _lightning_dvi(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lightning-dvi ARGS`` in a fresh process, as a user runs it."""
    script = Path(sys.executable).with_name("lightning-dvi")
    command = [str(script)] if script.is_file() else [sys.executable, "-m", "lightning_dvi.cli"]
    return subprocess.run([*command, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def _animals(path: Path, species: list[str], seed: int = 0, delimiter: str = ",") -> Path:
    """A table in the classification recipe's layout: flower_id, two inputs, species."""
    rng = np.random.default_rng(seed)
    centre = {"cat": 2.0, "dog": -2.0}
    rows = [delimiter.join(["flower_id", "x0", "x1", "species"])]
    for i, label in enumerate(species):
        x = rng.normal(size=2) + centre.get(label, 0.0)
        rows.append(delimiter.join([f"id{i}", f"{x[0]:.4f}", f"{x[1]:.4f}", label]))
    path.write_text("\n".join(rows) + "\n")
    return path


def test_a_label_only_in_the_test_file_is_refused_unless_the_classes_are_declared(tmp_path):
    """Item 4 as reported: 3 "bird" rows only in the test file became a third class with a
    never-trained ``prob_bird`` column, silently. Now the fit stops before training with exit
    code 2, naming the label, the file and how to declare the classes."""
    _animals(tmp_path / "catdog.csv", ["cat", "dog"] * 20)
    _animals(tmp_path / "catdog_test.csv", ["cat", "dog", "bird", "dog"] * 3, seed=1)
    args = ["fit", "--config", str(CLASSIFICATION), "--data.path", "catdog.csv",
            "--data.test_path", "catdog_test.csv", "--trainer.max_epochs", "1"]  # fmt: skip
    result = _lightning_dvi(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-3000:]
    assert (
        "catdog_test.csv, line 4, column 'species': class label 'bird' is not in the training "
        "file catdog.csv (its labels: ['cat', 'dog'])"
    ) in result.stderr
    assert """--data.labels '["cat", "dog", "bird"]'""" in result.stderr
    assert "Traceback" not in result.stderr and not list(tmp_path.glob("runs/**/*.ckpt"))
    # Declared, the classes keep the declared order and the bird class is allowed.
    run = cli([*args[1:], "--data.labels", "[cat, dog, bird]"], run=False)
    assert run.datamodule.labels == ["cat", "dog", "bird"] and run.model.num_classes == 3


def test_a_classifier_run_summary_lists_its_metrics_and_files_and_a_spent_resume_is_refused(
    tmp_path, capsys
):
    """Item 8, the classification recipe on a CSV: the summary was headed "regression: original
    units of y"; ``predict`` listed ``.pt`` and ``.csv`` but not the ``.parquet`` it wrote; and a
    resume with a ``max_epochs`` the checkpoint had passed ended in Lightning's traceback."""
    _animals(tmp_path / "animals.csv", ["cat", "dog", "emu"] * 10)
    config = ["--config", str(CLASSIFICATION), "--data.path", "animals.csv"]
    cli(["fit", *config, "--trainer.max_epochs", "3"])
    out = capsys.readouterr().out
    heading = "metrics (classification, 3 classes: nll in nats per example, acc and ece as "
    assert heading in out and "regression" not in out, out[-2000:]

    cli(["predict", *config, "--ckpt_path", "last"])
    out = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "csv_classification" / "lightning_logs" / "version_1"
    written = sorted(run_dir.glob("predictions.*"))
    assert [p.suffix for p in written] == [".csv", ".parquet", ".pt"]
    listed = [line.split(maxsplit=1)[1] for line in out.splitlines()
              if line.startswith("predictions: ")]  # fmt: skip
    assert sorted(Path(p).resolve() for p in listed) == written, out[-2000:]

    # As the user ran it, in a fresh process: the checkpoint has trained 3 epochs (its epoch 2),
    # so max_epochs 1 leaves nothing to train.
    resume = ["--ckpt_path", "last", "--trainer.max_epochs", "1"]
    spent = _lightning_dvi("fit", *config, *resume, cwd=tmp_path)
    assert spent.returncode == 1, spent.stdout[-2000:] + spent.stderr[-3000:]
    assert "Traceback" not in spent.stderr, spent.stderr[-3000:]
    checkpoint = run_dir.with_name("version_0").resolve() / "checkpoints" / "last.ckpt"
    assert (
        f"lightning-dvi fit: --trainer.max_epochs 1, but the checkpoint {checkpoint} has "
        "already trained 3 epochs (its epoch 2, counted from 0), so there is nothing left to "
        "train. To train on, raise the limit: --trainer.max_epochs 4 trains 1 more epochs"
    ) in spent.stderr, spent.stderr[-3000:]
    assert not run_dir.with_name("version_2").exists()  # refused before the run was set up
    # max_epochs equal to the epochs trained leaves nothing either; max_steps likewise.
    for limit in (["--trainer.max_epochs", "3"], ["--trainer.max_steps", "4"]):
        with pytest.raises(SystemExit, match="nothing left to train"):
            cli(["fit", *config, "--ckpt_path", "last", *limit])
    assert not run_dir.with_name("version_2").exists()


@pytest.mark.parametrize(
    ("delimiter", "hint"),
    [
        (";", "the header looks ';'-separated: pass --data.delimiter ';'"),
        ("|", "the header looks '|'-separated: pass --data.delimiter '|'"),
        ("\t", "the header looks tab-separated: name the file .tsv, or pass --data.delimiter"),
    ],
)
def test_a_file_with_another_delimiter_is_named_with_the_option_that_reads_it(
    tmp_path, capsys, delimiter, hint
):
    """Item 8: a ';'-separated file failed with "no column 'species' (columns in the file:
    flower_id;x0;...)" without naming --data.delimiter; the error now names it, and passing it
    reads the file."""
    _animals(tmp_path / "animals.csv", ["cat", "dog"] * 10, delimiter=delimiter)
    config = ["--config", str(CLASSIFICATION), "--data.path", "animals.csv"]
    with pytest.raises(SystemExit) as exit_info:
        cli(config, run=False)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    columns = delimiter.join(["flower_id", "x0", "x1", "species"])
    assert f"animals.csv: no column 'species' (columns in the file: {columns}); {hint}" in err
    run = cli([*config, "--data.delimiter", delimiter], run=False)
    assert run.datamodule.feature_names == ["x0", "x1"] and run.datamodule.labels == ["cat", "dog"]
