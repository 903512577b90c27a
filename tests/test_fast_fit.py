"""What a UCI-size fit pays besides the math (issue 31): gathered batches, a lean validation."""

import pytest
import torch
from helpers import cpu_trainer
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data._utils.collate import default_collate

from lightning_dvi import DVIRegressor
from lightning_dvi.data import UCIDataModule
from lightning_dvi.data._base import GatherTensorDataset, gathered
from lightning_dvi.metrics import RegressionMetrics


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """One torch thread: a second one only contends for the 2 shared cores."""


def _uci(tmp_path, rows=40, batch_size=8, val_fraction=0.0):
    folder = tmp_path / "toy"
    folder.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    data = torch.randn(rows, 4, generator=g, dtype=torch.float64)
    (folder / "data.txt").write_text(
        "\n".join(" ".join(f"{v:.6f}" for v in r) for r in data.tolist())
    )
    (folder / "index_features.txt").write_text("0\n1\n2\n")
    (folder / "index_target.txt").write_text("3\n")
    (folder / "index_train_0.txt").write_text("\n".join(str(i) for i in range(rows - 10)))
    (folder / "index_test_0.txt").write_text("\n".join(str(i) for i in range(rows - 10, rows)))
    return UCIDataModule(str(tmp_path), "toy", batch_size=batch_size, val_fraction=val_fraction)


class _RowCounting(TensorDataset):
    def __getitem__(self, index):
        raise AssertionError("a gathered batch must not read rows one by one")


def test_gathered_batches_equal_collated_rows(tmp_path):
    """The shuffled training loader and the evaluation loaders give default_collate's batches."""
    dm = _uci(tmp_path, batch_size=7, val_fraction=0.2)
    for loader, dataset in (
        (dm.train_dataloader(), dm.train_dataset),
        (dm.val_dataloader(), dm.val_dataset),
        (dm.test_dataloader(), dm.test_dataset),
    ):
        assert isinstance(loader.dataset, GatherTensorDataset)
        if hasattr(loader.sampler, "set_epoch"):  # the same seeded permutation twice
            loader.sampler.set_epoch(3)
        reference = DataLoader(dataset, batch_size=7, sampler=list(loader.sampler))
        if hasattr(loader.sampler, "set_epoch"):
            loader.sampler.set_epoch(3)
        batches = list(loader)
        assert len(batches) == len(reference) >= 1
        for got, want in zip(batches, reference, strict=True):
            assert isinstance(got, list) and len(got) == 2
            for a, b in zip(got, want, strict=True):
                assert a.dtype == b.dtype and torch.equal(a, b)
    # two epochs of the seeded sampler: two permutations, each a gather of the whole set
    full = _uci(tmp_path / "full", batch_size=30)
    loader = full.train_dataloader()
    x = full.train_dataset.tensors[0]
    epochs = [next(iter(loader))[0] for _ in range(2)]
    assert all(e.shape == x.shape for e in epochs) and not torch.equal(epochs[0], epochs[1])
    assert torch.equal(epochs[0].sort(0).values, x.sort(0).values)


def test_gather_dataset_never_reads_rows_one_by_one():
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    dataset = type("Gathering", (GatherTensorDataset, _RowCounting), {})(x, y)
    loader = DataLoader(dataset, batch_size=4, shuffle=False, collate_fn=gathered)
    (xa, ya), (xb, yb) = list(loader)
    assert torch.equal(xa, x[:4]) and torch.equal(ya, y[:4])
    assert torch.equal(xb, x[4:]) and torch.equal(yb, y[4:])
    rows = default_collate([TensorDataset(x, y)[i] for i in (5, 0, 3)])
    for a, b in zip(dataset.__getitems__([5, 0, 3]), rows, strict=True):
        assert torch.equal(a, b)


def test_regression_metrics_include_builds_only_the_members_named():
    metrics = RegressionMetrics(prefix="val/", include=["rmse", "nll"])
    assert list(metrics.keys(keep_base=True)) == ["nll", "rmse"]
    metrics.update(torch.zeros(4), torch.ones(4), torch.tensor([0.0, 1.0, -1.0, 2.0]))
    assert sorted(metrics.compute()) == ["val/nll", "val/rmse"]
    with pytest.raises(ValueError, match="include: unknown metric 'ece'"):
        RegressionMetrics(include=["ece"])


def test_val_metrics_selects_what_validation_logs(tmp_path):
    """val_metrics=["nll"] logs val/nll only, with the same value as the full validation."""
    values = {}
    for selection in (None, ["nll"]):
        dm = _uci(tmp_path / str(selection), batch_size=30, val_fraction=0.2)
        torch.manual_seed(0)
        model = DVIRegressor(
            hidden=[8], optimizer="lbfgs", lbfgs_iterations=3, val_metrics=selection
        )
        trainer = cpu_trainer(max_epochs=2, enable_checkpointing=False)
        trainer.fit(model, datamodule=dm)
        values[str(selection)] = {
            k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")
        }
    full, lean = values["None"], values["['nll']"]
    assert {"val/loss", "val/rmse", "val/mace", "val/epistemic_std"} <= set(full)
    assert set(lean) == {"val/nll"}
    assert lean["val/nll"] == pytest.approx(full["val/nll"], rel=1e-6)
    for bad, message in (
        ("nll", "val_metrics must be a non-empty list"),
        ([], "val_metrics must be a non-empty list"),
        (["accuracy"], "val_metrics: unknown metric 'accuracy'"),
    ):
        with pytest.raises(ValueError, match=message):
            DVIRegressor(in_features=3, hidden=[4], num_data=10, val_metrics=bad)


def test_val_metrics_without_elbo_skips_the_validation_elbo(tmp_path, monkeypatch):
    """val_metrics=["nll"]: the validation computes no ELBO (nothing logs it); training and
    testing still do, and the fit is the same to the last bit as with the ELBO computed."""
    import lightning_dvi.lightning._base as base

    calls = []
    real = base.elbo

    def counting(*args, **kwargs):
        calls.append(torch.is_grad_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(base, "elbo", counting)
    fits = {}
    for logs_elbo in (True, False):
        calls.clear()
        dm = _uci(tmp_path / str(logs_elbo), batch_size=30, val_fraction=0.2)
        torch.manual_seed(0)
        model = DVIRegressor(hidden=[8], optimizer="lbfgs", lbfgs_iterations=3, val_metrics=["nll"])
        model.logs_val_elbo = logs_elbo  # True: the old path, an ELBO per validation batch
        trainer = cpu_trainer(max_epochs=3, enable_checkpointing=False)
        trainer.fit(model, datamodule=dm)
        fits[logs_elbo] = (
            [p.detach().clone() for p in model.parameters()],
            float(trainer.callback_metrics["val/nll"]),
            calls.count(False),  # evaluations without grad: the validation's
        )
    (p_old, nll_old, val_old), (p_new, nll_new, val_new) = fits[True], fits[False]
    assert val_old >= 3 and val_new == 0  # (the sanity check validates too)
    assert nll_new == nll_old
    assert all(torch.equal(a, b) for a, b in zip(p_old, p_new, strict=True))


def test_val_metrics_elbo_only_skips_the_predictive(tmp_path):
    dm = _uci(tmp_path, batch_size=30, val_fraction=0.2)
    model = DVIRegressor(hidden=[4], optimizer="lbfgs", lbfgs_iterations=2, val_metrics=["elbo"])
    trainer = cpu_trainer(max_epochs=1, enable_checkpointing=False)
    trainer.fit(model, datamodule=dm)
    logged = {k for k in trainer.callback_metrics if k.startswith("val/")}
    assert logged == {"val/loss", "val/elbo", "val/expected_log_likelihood", "val/kl"}
