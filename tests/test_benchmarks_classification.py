"""lightning_dvi_benchmarks: splits, baselines (Laplace against autograd), the DVI row, the table."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import Tensor, nn

from lightning_dvi_benchmarks import baselines, classification
from lightning_dvi_benchmarks.baselines import Fitted
from lightning_dvi_benchmarks.classification import (
    Row,
    markdown_table,
    run_row,
    run_row_pooled,
    summarise,
)
from lightning_dvi_benchmarks.data import (
    Budget,
    ClassificationSplit,
    digits_folds,
    digits_split,
    plain_cnn,
    plain_mlp,
    synthetic_split,
)

TINY = Budget(epochs=2, lr=1e-2, batch_size=64)


@pytest.fixture(scope="module")
def small() -> ClassificationSplit:
    return digits_split("standardized", num_train=150)


def test_digits_split_sizes_strata_and_preprocessing() -> None:
    split = digits_split("standardized")
    assert (split.num_train, len(split.y_val), len(split.y_test)) == (1257, 180, 360)
    assert split.num_classes == 10 and split.input_shape == (64,)
    rows = torch.cat([split.x_train, split.x_val, split.x_test])
    assert len(torch.unique(rows, dim=0)) > 1700  # disjoint parts (a few digits are duplicates)
    for part in (split.y_train, split.y_val, split.y_test):  # stratified: every class present
        counts = torch.bincount(part, minlength=10).double()
        assert counts.min() >= 0.8 * counts.mean()
    moving = split.x_train.std(0) > 0
    assert torch.allclose(split.x_train.mean(0), torch.zeros(64), atol=1e-5)
    assert torch.allclose(
        split.x_train.std(0, unbiased=False)[moving], torch.ones(64)[moving], atol=1e-4
    )
    scaled = digits_split("scaled")
    assert torch.equal(scaled.y_test, split.y_test)  # the same split
    assert scaled.x_train.min() == 0 and scaled.x_train.max() == 1
    images = digits_split("global", images=True, num_train=200)
    assert images.input_shape == (1, 8, 8) and images.num_train == 200
    assert abs(float(images.x_train.mean())) < 1e-5
    with pytest.raises(ValueError, match="inputs"):
        digits_split("raw")  # type: ignore[arg-type]


def test_digits_folds_partition_every_digit_once() -> None:
    folds = digits_folds("standardized", folds=5)
    assert len(folds) == 5
    # the test sets partition the 1797 digits: every (input, label) row is tested exactly once
    raw = digits_folds("scaled", folds=5)
    tested = torch.cat([torch.cat([f.x_test, f.y_test[:, None].double()], 1) for f in raw])
    assert len(tested) == 1797
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    every = torch.cat([torch.tensor(x / 16.0), torch.tensor(y[:, None], dtype=torch.float64)], 1)
    assert torch.equal(torch.unique(tested, dim=0), torch.unique(every, dim=0))
    for fold in folds:
        assert len(fold.y_val) == 180 and fold.num_train + 180 + len(fold.y_test) == 1797
        for part in (fold.y_train, fold.y_val, fold.y_test):  # stratified
            counts = torch.bincount(part, minlength=10).double()
            assert counts.min() >= 0.8 * counts.mean()
        moving = fold.x_train.std(0) > 0  # standardised with the fold's own training rows
        assert torch.allclose(fold.x_train.mean(0), torch.zeros(64), atol=1e-5)
        assert torch.allclose(
            fold.x_train.std(0, unbiased=False)[moving], torch.ones(64)[moving], atol=1e-4
        )
    images = digits_folds("global", folds=2, images=True)
    assert images[0].input_shape == (1, 8, 8)
    assert torch.equal(digits_folds(folds=3)[1].y_test, digits_folds(folds=3)[1].y_test)
    with pytest.raises(ValueError, match="folds >= 2"):
        digits_folds(folds=1)
    with pytest.raises(ValueError, match="num_val"):
        digits_folds(folds=2, num_val=2000)


def test_run_row_pooled_scores_the_concatenated_predictions(monkeypatch) -> None:
    """Pooling: the metrics of the concatenated test predictions, each fold's own model."""
    folds = digits_folds("scaled", folds=3)
    gen = torch.Generator().manual_seed(0)
    made: list[tuple[Tensor, Tensor]] = []

    def fake_fit(split, row, budget, seed):
        w = torch.randn(64, 10, generator=gen)

        def predict(x: Tensor) -> Tensor:
            return (x.reshape(len(x), -1) @ w).softmax(-1)

        made.append((predict(split.x_test), split.y_test))
        return Fitted(predict, 1.5, 7)

    monkeypatch.setattr(classification, "fit_row", fake_fit)
    out = run_row_pooled(folds, Row("plain"), TINY, seed=0)
    probs, target = torch.cat([p for p, _ in made]), torch.cat([y for _, y in made])
    expected = classification.classification_summary(probs, target)
    for key in ("acc", "nll", "ece", "brier"):
        assert out[key] == pytest.approx(expected[key], rel=1e-6), key
    assert out["rows"] == 1797 and out["train_s"] == pytest.approx(4.5)
    assert out["best_epoch"] == [7, 7, 7] and 0 <= out["ood_auroc"] <= 1
    assert out["confidence"] == pytest.approx(float(probs.max(-1).values.mean()))
    assert 0 < out["ece_floor"] < out["ece"]  # random weights: far from calibrated
    with pytest.raises(ValueError, match="at least one split"):
        run_row_pooled([], Row("plain"), TINY, seed=0)


def test_run_row_pooled_trains_each_fold() -> None:
    folds = digits_folds("standardized", folds=2)
    out = run_row_pooled(folds, Row("plain", hidden=(16,)), TINY, seed=0)
    assert out["rows"] == 1797 and out["acc"] > 0.8 and len(out["best_epoch"]) == 2


def test_synthetic_split_is_deterministic_and_nested() -> None:
    a, b = synthetic_split(300), synthetic_split(600)
    assert (a.num_train, len(a.y_val), len(a.y_test), a.num_classes) == (300, 2000, 5000, 5)
    assert torch.equal(a.y_test, b.y_test) and torch.equal(a.y_train, b.y_train[:300])
    assert torch.equal(a.y_train, synthetic_split(300).y_train)


def test_ood_inputs_permute_the_features_of_the_test_rows(small: ClassificationSplit) -> None:
    ood = small.ood_inputs()
    assert ood.shape == small.x_test.shape
    assert torch.equal(ood.sort(-1).values, small.x_test.sort(-1).values)
    assert not torch.equal(ood, small.x_test)


def test_plain_networks() -> None:
    net = plain_mlp(64, (8, 8), 10, dropout=0.1)
    assert sum(isinstance(m, nn.Dropout) for m in net) == 2
    assert net(torch.zeros(3, 64)).shape == (3, 10)
    assert plain_cnn(10, hidden=(16,))(torch.zeros(2, 1, 8, 8)).shape == (2, 10)


def test_plain_keeps_the_best_validation_epoch(small: ClassificationSplit) -> None:
    make = lambda p: plain_mlp(64, (16,), 10, p)  # noqa: E731
    fit = baselines.fit_plain(small, make, Budget(epochs=4, lr=3e-2), 0)
    assert 0 <= fit.best_epoch < 4 and fit.net is not None
    assert math.isclose(
        fit.details["val_nll"], baselines.nll(fit.predict(small.x_val), small.y_val), rel_tol=1e-5
    )
    tuned = baselines.fit_plain_tuned(small, make, TINY, 0, weight_decays=(0.0, 0.1))
    assert tuned.details["weight_decay"] in (0.0, 0.1)
    others = [baselines.fit_plain(small, make, TINY, 0, wd) for wd in (0.0, 0.1)]
    assert tuned.details["val_nll"] == min(f.details["val_nll"] for f in others)


def test_ensemble_and_mc_dropout(small: ClassificationSplit) -> None:
    make = lambda p: plain_mlp(64, (16,), 10, p)  # noqa: E731
    ens = baselines.fit_ensemble(small, make, TINY, 0, members=3)
    assert ens.samples is not None
    samples = ens.samples(small.x_test, 3)
    assert samples.shape == (3, 360, 10)
    torch.testing.assert_close(ens.predict(small.x_test), samples.mean(0))
    drop = baselines.fit_mc_dropout(small, make, TINY, 0, rates=(0.1, 0.3), num_samples=8)
    assert drop.details["dropout"] in (0.1, 0.3)
    first, second = drop.predict(small.x_test), drop.predict(small.x_test)
    torch.testing.assert_close(first, second)  # fixed masks: deterministic
    torch.testing.assert_close(first.sum(-1), torch.ones(360))


def test_last_layer_ggn_is_the_autograd_hessian_of_the_cross_entropy() -> None:
    torch.manual_seed(0)
    net = plain_mlp(5, (4,), 3).double()
    x = torch.randn(20, 5, dtype=torch.float64)
    y = torch.randint(0, 3, (20,))
    last = net[-1]
    features = net[:-1](x).detach()

    def loss(theta: torch.Tensor) -> torch.Tensor:
        w, b = theta[:, :-1], theta[:, -1]
        return nn.functional.cross_entropy(features @ w.T + b, y, reduction="sum")

    theta = torch.cat([last.weight, last.bias[:, None]], -1).detach()
    hessian = torch.autograd.functional.hessian(loss, theta).reshape(15, 15)
    torch.testing.assert_close(baselines.last_layer_ggn(net, x.float().double()), hessian)


def test_laplace_tends_to_the_map_network_under_a_tight_prior(small: ClassificationSplit) -> None:
    make = lambda p: plain_mlp(64, (16,), 10, p)  # noqa: E731
    base = baselines.fit_plain(small, make, TINY, 0)
    tight = baselines.fit_last_layer_laplace(small, base, prior_precisions=(1e9,))
    torch.testing.assert_close(
        tight.predict(small.x_test), base.predict(small.x_test), atol=1e-3, rtol=0
    )
    chosen = baselines.fit_last_layer_laplace(small, base, prior_precisions=(1.0, 1e9))
    assert chosen.details["prior_precision"] in (1.0, 1e9)
    assert chosen.train_seconds >= base.train_seconds
    with pytest.raises(ValueError, match=r"nn\.Sequential"):
        baselines.fit_last_layer_laplace(
            small, baselines.Fitted(lambda x: x, 0.0, 0, net=nn.ReLU())
        )


def test_dvi_row_records_history_and_collapse_diagnostics(small: ClassificationSplit) -> None:
    out = run_row(small, Row("dvi", hidden=(16,), settings={"lr": 1e-2}), TINY, 0, mc_eval=8)
    assert len(out["history"]) == 2
    for key in ("val/nll", "val/entropy_ratio", "val/entropy_excess", "train/accuracy"):
        assert key in out["history"][-1]
    for key in ("acc", "nll", "ece", "brier", "ood_auroc", "ood_auroc_mi", "train_s", "confidence"):
        assert math.isfinite(out[key])


def test_cnn_rows_run(small: ClassificationSplit) -> None:
    images = digits_split("global", images=True, num_train=100)
    for kind in ("dvi", "plain"):
        out = run_row(images, Row(kind, arch="cnn", hidden=(8,)), Budget(epochs=1), 0, mc_eval=4)  # type: ignore[arg-type]
        assert 0 <= out["acc"] <= 1


def test_summary_and_markdown_table() -> None:
    runs = [{"acc": 0.9, "nll": 0.3, "train_s": 2.0}, {"acc": 0.8, "nll": 0.5, "train_s": 4.0}]
    stats = summarise(runs, ("acc", "nll", "train_s", "ece"))
    assert stats["acc"] == pytest.approx((0.85, 0.05))
    assert math.isnan(stats["ece"][0])
    table = markdown_table({"row": runs}, ("acc", "train_s", "ece")).splitlines()
    assert table[0] == "| model | acc | train_s | ece |"
    assert table[2] == "| row | 0.850 ± 0.050 | 3.0 | — |"


def test_unknown_row_kind_raises(small: ClassificationSplit) -> None:
    with pytest.raises(ValueError, match="row kind"):
        classification.fit_row(small, Row("svm"), TINY, 0)  # type: ignore[arg-type]


def test_numpy_free_of_global_state() -> None:
    # the splits use their own seeds: global numpy and torch state do not change them
    np.random.seed(1)
    torch.manual_seed(1)
    a = digits_split("scaled", num_train=100)
    np.random.seed(2)
    torch.manual_seed(2)
    assert torch.equal(a.x_train, digits_split("scaled", num_train=100).x_train)
