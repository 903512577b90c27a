"""Digit images, OOD inputs, the CNN and OOD recipes, the summary helper and the benchmark script."""

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score

from lightning_dvi import DVIClassifier
from lightning_dvi.cli import cli
from lightning_dvi.data import DigitsDataModule
from lightning_dvi.metrics import (
    ClassificationMetrics,
    classification_summary,
    mutual_information,
    predictive_entropy,
)
from lightning_dvi.nn import CNN

REPO = Path(__file__).resolve().parents[1]


def test_digit_images_and_ood_inputs():
    flat, images = DigitsDataModule(), DigitsDataModule(images=True)
    x_flat, y_flat = flat.test_dataset.tensors
    x_img, y_img = images.test_dataset.tensors
    assert x_img.shape == (359, 1, 8, 8) and images.in_features == 64
    torch.testing.assert_close(x_img.reshape(359, 64), x_flat)
    torch.testing.assert_close(y_img, y_flat)
    permuted = flat.ood_inputs("permuted", seed=1)
    assert permuted.shape == x_flat.shape
    # the same pixel values per image, in other positions
    torch.testing.assert_close(permuted.sort(-1).values, x_flat.sort(-1).values)
    assert not torch.equal(permuted, x_flat)
    torch.testing.assert_close(images.ood_inputs("permuted", seed=1).reshape(359, 64), permuted)
    noise = images.ood_inputs("noise")
    assert noise.shape == (359, 1, 8, 8) and abs(noise.std().item() - 1) < 0.05
    with pytest.raises(ValueError, match="kind must be"):
        flat.ood_inputs("svhn")


def test_global_standardisation_keeps_strokes_on_one_scale():
    pixel = DigitsDataModule(images=True)
    glob = DigitsDataModule(images=True, standardize="global")
    x_train = glob.train_dataset.tensors[0]
    assert abs(x_train.mean().item()) < 1e-5 and abs(x_train.std().item() - 1) < 1e-4
    assert glob.x_scale.unique().numel() == 1
    # per-pixel scaling blows up strokes on rarely-inked pixels; the global one cannot
    assert pixel.val_dataset.tensors[0].abs().max() > 50
    assert glob.val_dataset.tensors[0].abs().max() < 2
    with pytest.raises(ValueError, match="standardize must be"):
        DigitsDataModule(standardize="minmax")


def test_classification_summary_against_independent_references():
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(2 * torch.randn(80, 4, generator=gen), -1)
    target = torch.randint(0, 4, (80,), generator=gen)
    ood = torch.softmax(0.5 * torch.randn(60, 4, generator=gen), -1)
    samples = torch.softmax(torch.randn(8, 80, 4, generator=gen), -1)
    ood_samples = torch.softmax(2 * torch.randn(8, 60, 4, generator=gen), -1)
    out = classification_summary(probs, target, ood, samples, ood_samples)
    ref = ClassificationMetrics(4)
    ref.update(probs, target)
    for key, value in ref.compute().items():
        assert out[key] == pytest.approx(float(value))
    labels = np.r_[np.zeros(80), np.ones(60)]
    entropy = torch.cat([predictive_entropy(probs), predictive_entropy(ood)])
    assert out["ood_auroc"] == pytest.approx(roc_auc_score(labels, entropy), rel=1e-6)
    mi = torch.cat([mutual_information(samples), mutual_information(ood_samples)])
    assert out["ood_auroc_mi"] == pytest.approx(roc_auc_score(labels, mi), rel=1e-6)
    assert set(classification_summary(probs, target)) == {"acc", "nll", "brier", "ece", "aurc"}


@pytest.mark.usefixtures("cli_isolated")
@pytest.mark.parametrize("recipe", ["digits_cnn", "digits_ood"])
def test_recipes_run_and_log_ood_metrics(recipe):
    args = ["--config", str(REPO / "recipes" / f"{recipe}.yaml"), "--trainer.max_epochs", "1"]
    args += ["--trainer.limit_train_batches", "2", "--trainer.limit_val_batches", "1"]
    run = cli(["fit", *args])
    metrics = run.trainer.callback_metrics
    for key in ("test/acc", "test/ood_auroc", "test/ood_aupr", "test/ood_auroc_mi", "test/aurc"):
        assert key in metrics and np.isfinite(float(metrics[key])), key
    model = run.model
    assert isinstance(model, DVIClassifier)
    if recipe == "digits_cnn":
        assert isinstance(model.net, CNN) and model.mode == "diag"


def _benchmark_module():
    path = REPO / "recipes" / "classification_benchmark.py"
    spec = importlib.util.spec_from_file_location("classification_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_benchmark(monkeypatch, capsys, argv: list[str], out) -> tuple[str, dict]:
    """Run the recipe's main() with ``argv``; its stdout and the JSON it wrote."""
    bench = _benchmark_module()
    monkeypatch.setattr(sys, "argv", ["bench", *argv, "--json", str(out)])
    threads = torch.get_num_threads()
    try:
        bench.main()
    finally:
        torch.set_num_threads(threads)
    return capsys.readouterr().out, json.loads(out.read_text())["results"]


def _refused(monkeypatch, capsys, argv: list[str]) -> str:
    """The recipe's error message for a bad command line."""
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    with pytest.raises(SystemExit):
        _benchmark_module().main()
    return capsys.readouterr().err


def test_benchmark_script_smoke(tmp_path, monkeypatch, capsys):
    argv = ["--protocol", "cnn", "--rows", "plain,defaults", "--seeds", "1", "--epochs", "1"]
    stdout, results = _run_benchmark(
        monkeypatch, capsys, [*argv, "--interleave"], tmp_path / "results.json"
    )
    assert "| plain |" in stdout and "| defaults |" in stdout
    for row in ("plain", "defaults"):
        (run,) = results[row]
        assert 0 <= run["ood_auroc"] <= 1 and run["train_s"] > 0
    assert "ood_auroc_mi" in results["defaults"][0]
    assert "unknown rows" in _refused(monkeypatch, capsys, ["--rows", "nope"])


def test_benchmark_script_folds(tmp_path, monkeypatch, capsys):
    argv = ["--protocol", "scaled", "--rows", "plain,defaults", "--seeds", "1", "--epochs", "1"]
    stdout, results = _run_benchmark(
        monkeypatch, capsys, [*argv, "--folds", "2"], tmp_path / "pooled.json"
    )
    assert "scaled, 2 folds pooled: 1 seed(s)" in stdout and "| ece_floor |" in stdout
    for row in ("plain", "defaults"):
        (run,) = results[row]
        assert run["rows"] == 1797 and 0 < run["ece_floor"] < 0.1 and len(run["best_epoch"]) == 2
    assert "--folds" in _refused(monkeypatch, capsys, ["--protocol", "defaults", "--folds", "2"])
