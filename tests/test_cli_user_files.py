"""The CLI on a user's own files, as a user runs it (issue 44, items 4 and 8): a label seen only
in the test file, the summary's heading per task, the files ``predict`` lists, a resume whose
``max_epochs`` the checkpoint has already passed, and a file separated by another delimiter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dvi.cli import cli

REPO = Path(__file__).resolve().parents[1]
CLASSIFICATION = REPO / "recipes" / "csv_classification.yaml"
REGRESSION = REPO / "recipes" / "csv_regression.yaml"


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dvi"])
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


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
