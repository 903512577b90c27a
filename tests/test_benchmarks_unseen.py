"""Issue 41 item 4: the classification sets nobody tuned for, and the ``unseen`` benchmark protocol."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dvi_benchmarks import baselines
from lightning_dvi_benchmarks.data import (
    UNSEEN_SETS,
    Budget,
    ClassificationSplit,
    noisy_digits_split,
    plain_mlp,
    teacher_split,
)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sets() -> dict[str, ClassificationSplit]:
    return {name: make() for name, make in UNSEEN_SETS.items()}


def _rows(split: ClassificationSplit) -> list[torch.Tensor]:
    return [split.x_train, split.x_val, split.x_test]


def test_promised_shapes_and_disjoint_parts(sets: dict[str, ClassificationSplit]) -> None:
    for name, split in sets.items():
        assert len(split.y_test) >= 1000 and split.num_classes == 10, name
        for x, y in zip(_rows(split), (split.y_train, split.y_val, split.y_test), strict=True):
            assert x.dtype == torch.float32 and y.dtype == torch.int64 and len(x) == len(y)
            assert torch.isfinite(x).all() and set(y.unique().tolist()) == set(range(10)), name
        # no input row in two parts
        joined = torch.cat(_rows(split))
        assert len(torch.unique(joined, dim=0)) == len(joined), name
    assert sets["noisy_digits"].input_shape == (64,)
    assert sets["noisy_digits"].num_train == 4 * (1797 - 1000 - 200)
    assert sets["overlap"].input_shape == sets["teacher"].input_shape == (20,)
    for name in ("overlap", "noisy_digits"):  # standardised with the training rows
        x = sets[name].x_train
        assert torch.allclose(x.mean(0), torch.zeros(x.shape[1]), atol=1e-4)
        assert torch.allclose(x.std(0, unbiased=False), torch.ones(x.shape[1]), atol=1e-3)


def test_same_seed_same_data_other_seed_other_data() -> None:
    for name, make in UNSEEN_SETS.items():
        a, b, c = make(split_seed=3), make(split_seed=3), make(split_seed=4)
        for first, second, third in zip(_rows(a), _rows(b), _rows(c), strict=True):
            assert torch.equal(first, second), name
            assert first.shape == third.shape and not torch.equal(first, third), name
        assert torch.equal(a.y_test, b.y_test), name


def _blank_windows(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per row: whether some ``block`` x ``block`` window holds only raw-zero pixels.

    Pixels are non-negative before standardisation, so a raw 0 is its column's minimum.
    """
    zero = torch.isclose(x, x.min(0).values.expand_as(x), atol=1e-6).reshape(-1, 1, 8, 8)
    windows = torch.nn.functional.avg_pool2d(zero.double(), block, stride=1)
    return (windows > 1 - 1e-9).flatten(1).any(-1)


def test_noisy_digits_blank_a_square_of_every_image() -> None:
    blanked = noisy_digits_split(noise=0.0, block=4, copies=2)
    clean = noisy_digits_split(noise=0.0, block=0, copies=2)
    assert torch.isfinite(clean.x_train).all()  # constant pixels: scale 1, no division by 0
    for x in (blanked.x_train, blanked.x_test):
        assert _blank_windows(x, 4).all()
    # the same digits in the same order: blanking only adds zeros, and adds some to most rows
    zeros = [
        torch.isclose(s.x_test, s.x_test.min(0).values.expand_as(s.x_test), atol=1e-6).sum(-1)
        for s in (blanked, clean)
    ]
    assert torch.equal(blanked.y_test, clean.y_test) and (zeros[0] >= zeros[1]).all()
    assert (zeros[0] > zeros[1]).double().mean() > 0.9
    assert not _blank_windows(clean.x_test, 4).all()
    # copies: each training digit twice, with independent blank squares
    assert torch.equal(clean.x_train[0::2], clean.x_train[1::2])
    assert not torch.equal(blanked.x_train[0::2], blanked.x_train[1::2])
    counts = torch.bincount(clean.y_test, minlength=10).double()  # stratified
    assert counts.min() >= 0.8 * counts.mean() and len(clean.y_test) == 1000


def test_teacher_labels_follow_the_kept_probabilities() -> None:
    """Monte Carlo oracle: the labels are draws from ``test_probs``, class by class."""
    split = teacher_split(num_train=100, num_val=100, num_test=20_000)
    probs = split.test_probs
    assert probs is not None and probs.shape == (20_000, 10)
    assert torch.allclose(probs.sum(-1), torch.ones(20_000), atol=1e-5)
    hits = torch.nn.functional.one_hot(split.y_test, 10).double()
    gap = (hits - probs.double()).mean(0)
    se = (probs.double() * (1 - probs.double())).mean(0).sqrt() / 20_000**0.5
    assert (gap.abs() < 4 * se).all()
    # the Bayes-optimal predictive of the default set is far from perfect and far from chance
    default = teacher_split()
    assert default.test_probs is not None
    bayes = float((default.test_probs.argmax(-1) == default.y_test).double().mean())
    assert 0.75 < bayes < 0.9


@pytest.mark.parametrize("name", list(UNSEEN_SETS))
def test_a_plain_mlp_lands_in_the_promised_regime(
    name: str, sets: dict[str, ClassificationSplit]
) -> None:
    """A plain 128-128 MLP (8 epochs: its validation-best epoch is 2-8) scores 0.5-0.85."""
    split = sets[name]
    make = lambda p: plain_mlp(split.input_shape[0], (128, 128), 10, p)  # noqa: E731
    fit = baselines.fit_plain(split, make, Budget(epochs=8), seed=0)
    acc = float((fit.predict(split.x_test).argmax(-1) == split.y_test).double().mean())
    assert 0.5 <= acc <= 0.85, acc


def _benchmark_module():
    path = REPO / "recipes" / "classification_benchmark.py"
    spec = importlib.util.spec_from_file_location("classification_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_unseen_protocol_runs_end_to_end(tmp_path, monkeypatch, capsys) -> None:
    out = tmp_path / "unseen.json"
    argv = ["--protocol", "unseen", "--sets", "teacher", "--seeds", "1", "--epochs", "1"]
    argv += ["--plots", str(tmp_path), "--json", str(out), "--dvi-settings", '{"kl_weight": 1.0}']
    monkeypatch.setattr(sys, "argv", ["bench", *argv])
    threads = torch.get_num_threads()
    try:
        _benchmark_module().main()
    finally:
        torch.set_num_threads(threads)
    stdout = capsys.readouterr().out
    assert "| ece_floor |" in stdout
    dvi = 'true_defaults {"kl_weight": 1.0} (teacher)'
    for row in ("plain_128 (teacher)", dvi, "bayes (teacher)"):
        assert f"| {row} |" in stdout
    results = json.loads(out.read_text())["results"]
    assert results[dvi][0]["details"]["settings"] == {"kl_weight": 1.0}
    png = tmp_path / "classification_unseen_teacher.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for row in ("plain_128 (teacher)", dvi):
        (run,) = results[row]
        bins = {k: np.array(v) for k, v in run["reliability"].items()}
        assert bins["count"].sum() == 2000
        # the bins reproduce the reported (torchmetrics) ECE
        ece = (bins["count"] * np.abs(bins["accuracy"] - bins["confidence"])).sum() / 2000
        assert ece == pytest.approx(run["ece"], abs=1e-5)
        assert 0 < run["ece_floor"] < 0.1
    # the per-seed rows and the acceptance lines, printed by the run and by a replay of its JSON
    verdict = f"| teacher | {dvi.removesuffix(' (teacher)')} |"
    assert "| teacher | 0 | plain_128 |" in stdout and verdict in stdout
    replay = ["--protocol", "unseen", "--sets", "teacher", "--replay", str(out)]
    monkeypatch.setattr(sys, "argv", ["bench", *replay, "--plots", str(tmp_path / "again")])
    _benchmark_module().main()
    assert verdict in capsys.readouterr().out
    assert (tmp_path / "again" / png.name).read_bytes() == png.read_bytes()
    monkeypatch.setattr(sys, "argv", ["bench", "--protocol", "unseen", "--sets", "nope"])
    with pytest.raises(SystemExit):
        _benchmark_module().main()
    assert "unknown sets" in capsys.readouterr().err


def _selected(split: ClassificationSplit, **settings: object) -> baselines.Fitted:
    from lightning_dvi_benchmarks.classification import Row, fit_dvi_selected

    row = Row("dvi_select", hidden=(8,), settings=settings)
    return fit_dvi_selected(split, Budget(epochs=3, lr=1e-2, batch_size=64), 0, row)


def _val_log_probs(fitted: baselines.Fitted, split: ClassificationSplit) -> np.ndarray:
    probs = fitted.predict(split.x_val).double().numpy()
    return np.log(np.take_along_axis(probs, split.y_val.numpy()[:, None], 1)[:, 0])


def test_selected_row_leaves_the_reference_only_on_a_paired_gain_of_z_standard_errors() -> None:
    split = teacher_split(num_train=200, num_val=120, num_test=50, num_classes=3)
    # the reference barely trains (lr 1e-4): the second candidate should beat it clearly
    candidates = [{"lr": 1e-4}, {"lr": 1e-2, "kl_weight": 1.0, "prior_variance": 0.3}]
    stay = _selected(split, candidates=candidates, z=1e9)  # no gain is that large
    move = _selected(split, candidates=candidates, z=0.0)  # any gain will do
    assert stay.details["chosen"] == 0 and stay.details["chosen_factor"] == 1.0
    assert stay.details["chosen_kind"] == "trained"
    assert stay.details["chosen_settings"] == candidates[0]
    table = move.details["variants"]
    assert table == stay.details["variants"]  # the same fits (seeded)
    # per candidate: as trained, then the library's post-hoc variants (select_classifier)
    kinds = ["trained", "temperature", "temperature+floor", "scale", "scale+temperature",
             "scale+temperature+floor"]  # fmt: skip
    assert [(v["candidate"], v["kind"]) for v in table] == [(m, k) for m in (0, 1) for k in kinds]
    for m in (0, 1):
        trained = table[6 * m]
        assert all(v["val_nll"] <= trained["val_nll"] + 1e-6 for v in table[6 * m : 6 * m + 6])
    best = min(range(12), key=lambda v: table[v]["val_nll"])
    assert best >= 6 and move.details["chosen"] == 1
    assert move.details["chosen_factor"] == table[best]["scale"]
    assert move.details["chosen_temperature"] == table[best]["temperature"]
    # oracle: the kept predictives' validation NLL, paired gain and its standard error
    ref, kept = _val_log_probs(stay, split), _val_log_probs(move, split)
    diff = kept - ref
    assert -ref.mean() == pytest.approx(table[0]["val_nll"], abs=1e-6)
    assert -kept.mean() == pytest.approx(table[best]["val_nll"], abs=1e-5)
    assert table[best]["gain"] == pytest.approx(diff.mean(), abs=1e-5)
    se = diff.std(ddof=1) / np.sqrt(len(diff))
    assert table[best]["gain_se"] == pytest.approx(se, rel=1e-3)
    assert table[0]["gain"] == 0.0
    # the analysis: every variant's test metrics, and each candidate's own calibrate=True choice
    tests = move.details["variant_test"]
    assert len(tests) == 12 and tests[best]["nll"] == pytest.approx(
        baselines.nll(move.predict(split.x_test), split.y_test), abs=1e-5
    )
    own = move.details["own_choice"]
    assert table[own[0]]["candidate"] == 0 and table[own[1]]["candidate"] == 1
    # the default z = 2 follows the rule on these numbers
    rule = _selected(split, candidates=candidates)
    wins = [v for v in range(1, 12) if table[v]["gain"] > 2 * table[v]["gain_se"]]
    expected = min([0, *wins], key=lambda v: table[v]["val_nll"])
    assert rule.details["chosen"] == table[expected]["candidate"]
    assert rule.details["chosen_factor"] == table[expected]["scale"]


def test_selected_row_without_calibration_scores_the_trained_predictive() -> None:
    from lightning_dvi_benchmarks.classification import Row, fit_dvi_selected

    split = teacher_split(num_train=150, num_val=80, num_test=40, num_classes=3)
    fitted = _selected(split, candidates=[{"lr": 1e-2}], calibrate=False)
    ((variant,),) = [fitted.details["variants"]]
    assert variant["scale"] == 1.0 and variant["kind"] == "trained"
    assert fitted.details["chosen"] == 0
    nll = baselines.nll(fitted.predict(split.x_val), split.y_val)
    assert variant["val_nll"] == pytest.approx(nll, abs=1e-6)
    for bad in ({}, {"candidates": []}, {"candidates": [{}], "other": 1}):
        with pytest.raises(ValueError, match="dvi_select needs"):
            fit_dvi_selected(split, Budget(epochs=1), 0, Row("dvi_select", settings=bad))
