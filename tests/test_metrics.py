"""Metrics against independent numpy/scipy definitions, accumulation, validation and DDP sync."""

from __future__ import annotations

import itertools
import os
import socket
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from scipy import integrate, stats

from lightning_dvi.metrics import (
    RMSE,
    BrierScore,
    ClassificationMetrics,
    ClassificationNLL,
    GaussianCRPS,
    GaussianNLL,
    IntervalCoverage,
    RegressionCalibrationError,
    RegressionMetrics,
    Sharpness,
    classification_metrics,
    functional,
    regression_metrics,
)

TOL = 1e-6
LEVELS = (0.5, 0.9, 0.95)


def _regression_data(n: int = 97, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = np.random.default_rng(seed)
    mean = gen.normal(size=n) * 3.0
    var = gen.uniform(0.05, 4.0, size=n)
    # Targets from a predictive of a different scale, so calibration errors are far from zero.
    target = mean + gen.normal(size=n) * np.sqrt(var) * 1.7 + 0.3
    return tuple(torch.from_numpy(a) for a in (mean, var, target))


def _classification_data(n: int = 113, k: int = 4, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = np.random.default_rng(seed)
    logits = gen.normal(size=(n, k)) * 2.0
    probs = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    target = gen.integers(0, k, size=n)
    return torch.from_numpy(probs), torch.from_numpy(target)


def _batches(*tensors: torch.Tensor, sizes: tuple[int, ...] = (10, 1, 40)):
    """Uneven batches covering all rows, to exercise accumulation over several updates."""
    cuts = [*np.cumsum((0, *sizes)).tolist(), len(tensors[0])]
    for lo, hi in itertools.pairwise(cuts):
        yield tuple(t[lo:hi] for t in tensors)


# ---- independent references (numpy / scipy, float64) -------------------------------------


def ref_nll(mu, var, y):
    return float(-stats.norm.logpdf(y, loc=mu, scale=np.sqrt(var)).mean())


def ref_rmse(mu, var, y):
    return float(np.sqrt(np.mean((y - mu) ** 2)))


def ref_crps_quad(mu, var, y):
    """CRPS as the integral of (F(x) - 1[x >= y])^2, by quadrature."""
    total = 0.0
    for m, s, t in zip(mu, np.sqrt(var), y, strict=True):
        below, _ = integrate.quad(lambda x, m=m, s=s: stats.norm.cdf(x, m, s) ** 2, -np.inf, t)
        above, _ = integrate.quad(lambda x, m=m, s=s: stats.norm.sf(x, m, s) ** 2, t, np.inf)
        total += below + above
    return total / len(y)


def ref_proportions(mu, var, y, levels):
    """uncertainty-toolbox's get_proportion_lists_vectorized (prop_type="interval")."""
    z = ((y - mu) / np.sqrt(var)).reshape(-1, 1)
    lower = stats.norm.ppf(0.5 - np.asarray(levels) / 2.0)
    upper = stats.norm.ppf(0.5 + np.asarray(levels) / 2.0)
    return ((z >= lower) & (z <= upper)).mean(axis=0)


def ref_calibration(mu, var, y, num_levels):
    expected = np.linspace(0, 1, num_levels)
    gap = ref_proportions(mu, var, y, expected) - expected
    return float(np.mean(np.abs(gap))), float(np.sqrt(np.mean(gap**2)))


def ref_class(probs, y, n_bins=15):
    picked = probs[np.arange(len(y)), y]
    nll = float(-np.log(np.maximum(picked, 1e-12)).mean())
    brier = float(((probs - np.eye(probs.shape[1])[y]) ** 2).sum(axis=1).mean())
    pred, conf = probs.argmax(axis=1), probs.max(axis=1)
    acc = float((pred == y).mean())
    bins = np.minimum(np.floor(conf * n_bins).astype(int), n_bins - 1)
    ece = 0.0
    for b in range(n_bins):
        members = bins == b
        if members.any():
            ece += members.mean() * abs((pred[members] == y[members]).mean() - conf[members].mean())
    return {"acc": acc, "nll": nll, "brier": brier, "ece": float(ece)}


def _numpy(*tensors):
    return tuple(t.numpy() for t in tensors)


# ---- single metrics against their references ------------------------------------------------


@pytest.mark.parametrize(
    ("metric_cls", "reference"),
    [(GaussianNLL, ref_nll), (RMSE, ref_rmse), (Sharpness, lambda m, v, y: np.sqrt(v.mean()))],
)
def test_scalar_regression_metrics_match_reference(metric_cls, reference):
    data = _regression_data()
    metric = metric_cls().set_dtype(torch.float64)
    for batch in _batches(*data):
        metric.update(*batch)
    assert metric.compute().item() == pytest.approx(reference(*_numpy(*data)), abs=TOL)


def test_crps_matches_quadrature():
    data = _regression_data(n=30)
    metric = GaussianCRPS().set_dtype(torch.float64)
    for batch in _batches(*data, sizes=(7, 12)):
        metric.update(*batch)
    assert metric.compute().item() == pytest.approx(ref_crps_quad(*_numpy(*data)), abs=TOL)


def test_crps_zero_variance_is_absolute_error():
    metric = GaussianCRPS().set_dtype(torch.float64)
    metric.update(
        torch.tensor([0.0, 1.0]), torch.zeros(2, dtype=torch.float64), torch.tensor([2.0, 1.0])
    )
    assert metric.compute().item() == pytest.approx(1.0, abs=1e-12)


def test_interval_coverage_matches_reference():
    data = _regression_data()
    metric = IntervalCoverage(LEVELS).set_dtype(torch.float64)
    for batch in _batches(*data):
        metric.update(*batch)
    result = metric.compute()
    expected = ref_proportions(*_numpy(*data), LEVELS)
    assert list(result) == ["coverage_50", "coverage_90", "coverage_95"]
    for value, ref in zip(result.values(), expected, strict=True):
        assert value.item() == pytest.approx(ref, abs=TOL)


@pytest.mark.parametrize("num_levels", [2, 11, 100])
def test_calibration_error_matches_uncertainty_toolbox_definition(num_levels):
    data = _regression_data()
    metric = RegressionCalibrationError(num_levels).set_dtype(torch.float64)
    for batch in _batches(*data):
        metric.update(*batch)
    mace, rmsce = ref_calibration(*_numpy(*data), num_levels)
    result = metric.compute()
    assert result["mace"].item() == pytest.approx(mace, abs=TOL)
    assert result["rmsce"].item() == pytest.approx(rmsce, abs=TOL)
    expected, observed = metric.curve()
    np.testing.assert_allclose(expected.numpy(), np.linspace(0, 1, num_levels), atol=1e-12)
    np.testing.assert_allclose(observed.numpy(), ref_proportions(*_numpy(*data), expected.numpy()))


def test_interval_edges_zero_variance_and_levels_zero_and_one():
    mean = torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64)
    var = torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)
    target = torch.tensor([0.0, 5.0, 2.0], dtype=torch.float64)
    hits = functional.central_interval_hits(mean, var, target, torch.tensor([0.0, 0.5, 1.0]))
    # A point mass covers only its own value; level 0 is the point mu; level 1 the whole line.
    expected = [[True, True, True], [False, False, True], [False, False, True]]
    assert hits.tolist() == expected


def test_float32_defaults_agree_with_float64():
    data = _regression_data()
    low = regression_metrics()
    high = regression_metrics().set_dtype(torch.float64)
    low.update(*(t.float() for t in data))
    high.update(*data)
    result = low.compute()
    for name, value in high.compute().items():
        assert result[name].dtype == torch.float32
        assert result[name].item() == pytest.approx(value.item(), rel=1e-5, abs=1e-6), name


def test_calibrated_predictive_scores_well():
    gen = torch.Generator().manual_seed(1)
    mean = torch.randn(20000, generator=gen, dtype=torch.float64)
    var = torch.rand(20000, generator=gen, dtype=torch.float64) + 0.1
    target = mean + var.sqrt() * torch.randn(20000, generator=gen, dtype=torch.float64)
    metrics = regression_metrics().set_dtype(torch.float64)
    metrics.update(mean, var, target)
    result = metrics.compute()
    assert result["mace"] < 0.01 and result["rmsce"] < 0.015
    for level in LEVELS:
        assert result[f"coverage_{100 * level:g}"].item() == pytest.approx(level, abs=0.015)


def test_classification_metrics_match_reference():
    probs, target = _classification_data()
    metrics = classification_metrics(4).set_dtype(torch.float64)
    nll, brier = ClassificationNLL().set_dtype(torch.float64), BrierScore().set_dtype(torch.float64)
    for batch in _batches(probs, target):
        metrics.update(*batch)
        nll.update(*batch)
        brier.update(*batch)
    expected = ref_class(*_numpy(probs, target))
    result = metrics.compute()
    assert sorted(result) == ["acc", "brier", "ece", "nll"]
    for name, ref in expected.items():
        assert result[name].item() == pytest.approx(ref, abs=TOL), name
    assert nll.compute().item() == pytest.approx(expected["nll"], abs=TOL)
    assert brier.compute().item() == pytest.approx(expected["brier"], abs=TOL)


def test_classification_nll_clamps_zero_probability():
    metric = ClassificationNLL()
    metric.update(torch.tensor([[1.0, 0.0]]), torch.tensor([1]))
    assert metric.compute().item() == pytest.approx(-np.log(1e-12), rel=1e-5)


# ---- collections ---------------------------------------------------------------------------


def test_regression_collection_names_and_values():
    data = _regression_data()
    metrics = RegressionMetrics(prefix="val/").set_dtype(torch.float64)
    for batch in _batches(*data):
        metrics.update(*batch)
    result = metrics.compute()
    names = [
        "nll",
        "rmse",
        "crps",
        "coverage_50",
        "coverage_90",
        "coverage_95",
        "mace",
        "rmsce",
        "sharpness",
    ]
    assert sorted(result) == sorted(f"val/{n}" for n in names)
    assert all(v.ndim == 0 for v in result.values())
    mu, var, y = _numpy(*data)
    assert result["val/nll"].item() == pytest.approx(ref_nll(mu, var, y), abs=TOL)
    assert result["val/mace"].item() == pytest.approx(ref_calibration(mu, var, y, 100)[0], abs=TOL)
    # forward returns the batch's own values and still accumulates.
    test_metrics = metrics.clone(prefix="test/")
    test_metrics.reset()
    batch_values = test_metrics(*data)
    assert batch_values["test/rmse"].item() == pytest.approx(ref_rmse(mu, var, y), abs=TOL)
    assert test_metrics.compute()["test/rmse"].item() == pytest.approx(
        ref_rmse(mu, var, y), abs=TOL
    )


def test_merge_state_equals_union():
    data = _regression_data()
    first, second = RegressionCalibrationError(), RegressionCalibrationError()
    whole = RegressionCalibrationError()
    first.update(*(t[:40] for t in data))
    second.update(*(t[40:] for t in data))
    whole.update(*data)
    first.merge_state(second)
    assert first.compute() == whole.compute()


# ---- validation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((torch.zeros(3), torch.ones(4), torch.zeros(3)), "same shape"),
        ((torch.zeros(3), torch.ones(3), torch.zeros(3, 1)), "same shape"),
        ((torch.tensor([0.0, float("nan")]), torch.ones(2), torch.zeros(2)), "mean contains NaN"),
        ((torch.zeros(2), torch.ones(2), torch.tensor([float("nan"), 0.0])), "target contains NaN"),
        ((torch.zeros(2), torch.tensor([1.0, -0.1]), torch.zeros(2)), "non-negative"),
        ((torch.zeros(2), torch.ones(2), torch.tensor([float("inf"), 0.0])), "infinite"),
        ((torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long)), "floating-point"),
    ],
)
@pytest.mark.parametrize("factory", [GaussianNLL, RMSE, IntervalCoverage, regression_metrics])
def test_regression_input_validation(factory, args, message):
    with pytest.raises(ValueError, match=message):
        factory().update(*args)


@pytest.mark.parametrize(
    ("probs", "target", "message"),
    [
        (torch.full((2, 3), 0.2), torch.tensor([0, 1]), "sum to 1"),
        (torch.full((2, 3), 1 / 3), torch.tensor([0, 3]), r"\[0, 3\)"),
        (torch.full((2, 3), 1 / 3), torch.tensor([0.0, 1.0]), "integer class labels"),
        (torch.full((2, 3), 1 / 3), torch.tensor([0, 1, 2]), "batch size"),
        (torch.full((3,), 1 / 3), torch.tensor([0]), r"\[B, K\]"),
        (torch.tensor([[float("nan"), 0.5, 0.5]]), torch.tensor([0]), "NaN"),
        (torch.tensor([[1.5, -0.5, 0.0]]), torch.tensor([0]), r"lie in \[0, 1\]"),
    ],
)
@pytest.mark.parametrize(
    "factory", [ClassificationNLL, BrierScore, lambda: classification_metrics(3)]
)
def test_classification_input_validation(factory, probs, target, message):
    with pytest.raises(ValueError, match=message):
        factory().update(probs, target)


def test_constructor_validation():
    with pytest.raises(ValueError, match=r"\(0, 1\)"):
        IntervalCoverage((0.5, 1.0))
    with pytest.raises(ValueError, match="distinct"):
        IntervalCoverage((0.5, 0.5))
    with pytest.raises(ValueError, match="at least 2"):
        RegressionCalibrationError(1)
    with pytest.raises(ValueError, match="classes"):
        ClassificationMetrics(4).update(torch.full((1, 3), 1 / 3), torch.tensor([0]))


# ---- DDP: two gloo processes reproduce the single-process result on the union ---------------


def _ddp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        reg, cls = _regression_data(), _classification_data()
        # Uneven shards (30 / 67 and 50 / 63 rows), two updates each.
        reg_rows = slice(0, 30) if rank == 0 else slice(30, None)
        cls_rows = slice(0, 50) if rank == 0 else slice(50, None)
        regression = RegressionMetrics().set_dtype(torch.float64)
        classification = ClassificationMetrics(4).set_dtype(torch.float64)
        for batch in _batches(*(t[reg_rows] for t in reg), sizes=(13,)):
            regression.update(*batch)
        for batch in _batches(*(t[cls_rows] for t in cls), sizes=(21,)):
            classification.update(*batch)
        result = {
            **regression.compute(),
            **{f"cls_{k}": v for k, v in classification.compute().items()},
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ddp_two_process_sync_equals_single_process(tmp_path):
    # forked, not spawned: the processes are what the check needs (two gloo ranks, each with its
    # own shard); a spawned one first re-imports torch, scipy and this module (~7 s of CPU each)
    mp.start_processes(
        _ddp_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True,
        start_method="fork",
    )  # fmt: skip
    single_reg = RegressionMetrics().set_dtype(torch.float64)
    single_reg.update(*_regression_data())
    single_cls = ClassificationMetrics(4).set_dtype(torch.float64)
    single_cls.update(*_classification_data())
    expected = {**single_reg.compute(), **{f"cls_{k}": v for k, v in single_cls.compute().items()}}
    for rank in range(2):
        synced = torch.load(tmp_path / f"rank{rank}.pt")
        assert synced.keys() == expected.keys()
        for name, value in expected.items():
            assert synced[name].item() == pytest.approx(value.item(), abs=1e-12), (rank, name)


def test_ece_noise_floor_matches_torchmetrics_over_labels_drawn_from_the_predictions():
    """Oracle: torchmetrics' ECE averaged over labels sampled (multinomial) from the predictions."""
    from torchmetrics.functional.classification import multiclass_calibration_error

    from lightning_dvi.metrics import ece_noise_floor

    gen = torch.Generator().manual_seed(3)
    probs = (3.0 * torch.randn(360, 10, generator=gen, dtype=torch.float64)).softmax(-1)
    draws = [
        float(
            multiclass_calibration_error(
                probs, torch.multinomial(probs, 1, generator=gen)[:, 0], num_classes=10, n_bins=15
            )
        )
        for _ in range(2000)
    ]
    reference = float(np.mean(draws))
    floor = ece_noise_floor(probs, draws=4000)
    assert floor == pytest.approx(reference, rel=0.03)
    # the floor falls like 1/sqrt(N): four times the rows (the same predictions), half the floor
    many = ece_noise_floor(probs.repeat(4, 1), draws=4000)
    assert many == pytest.approx(floor / 2, rel=0.1)
    assert ece_noise_floor(probs, draws=50, seed=1) == ece_noise_floor(probs, draws=50, seed=1)
    assert ece_noise_floor(torch.eye(4)) == 0.0  # certain (and right) predictions do not scatter


@pytest.mark.parametrize(
    "probs, draws",
    [
        (torch.ones(0, 3), 10),
        (torch.ones(3), 10),
        (torch.eye(3), 0),
        (torch.tensor([[float("nan"), 0.5]]), 10),
        (torch.tensor([[1.5, -0.5]]), 10),
    ],
)
def test_ece_noise_floor_rejects_bad_input(probs, draws):
    from lightning_dvi.metrics import ece_noise_floor

    with pytest.raises(ValueError, match="ece_noise_floor"):
        ece_noise_floor(probs, draws=draws)


def test_pit_hits_are_the_gaussian_interval_hits_for_a_gaussian() -> None:
    from lightning_dvi.metrics.functional import (
        central_interval_hits,
        central_interval_hits_from_pit,
    )

    gen = torch.Generator().manual_seed(11)
    mean = torch.randn(4000, generator=gen, dtype=torch.float64)
    var = torch.rand(4000, generator=gen, dtype=torch.float64) + 0.1
    target = mean + 2.0 * var.sqrt() * torch.randn(4000, generator=gen, dtype=torch.float64)
    levels = torch.linspace(0.0, 1.0, 101, dtype=torch.float64)
    pit = torch.tensor(stats.norm.cdf(target.numpy(), mean.numpy(), var.sqrt().numpy()))
    from_moments = central_interval_hits(mean, var, target, levels)
    from_pit = central_interval_hits_from_pit(pit, levels)
    assert (from_moments == from_pit).double().mean() > 1 - 1e-4  # only exact boundary ties
    assert from_pit[:, -1].all() and from_pit.sum(0).diff().ge(0).all()


def test_coverage_and_calibration_read_the_pit_when_given() -> None:
    from lightning_dvi.metrics import RegressionMetrics

    mean, var = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    target = torch.tensor([0.0, 0.5, 1.0, 2.0, 3.0], dtype=torch.float64)
    pit = torch.tensor([0.5, 0.6, 0.7, 0.9, 0.999], dtype=torch.float64)  # a wider predictive
    metrics = RegressionMetrics(coverage_levels=(0.5, 0.9))
    metrics.update(mean, var, target, pit=pit)
    computed = metrics.compute()
    assert float(computed["coverage_50"]) == pytest.approx(3 / 5)  # |2u - 1| <= 0.5
    assert float(computed["coverage_90"]) == pytest.approx(4 / 5)
    plain = RegressionMetrics(coverage_levels=(0.5, 0.9))
    plain.update(mean, var, target)  # the Gaussian's intervals: +-0.674 and +-1.645
    assert float(plain.compute()["coverage_50"]) == pytest.approx(2 / 5)
    with pytest.raises(ValueError, match="pit has shape"):
        RegressionMetrics().update(mean, var, target, pit=pit[:3])
