"""DataModules: the shared UCI data, synthetic UCI-layout error cases, toy data, digits."""

from __future__ import annotations

import os
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch

from lightning_dvi.data import (
    DigitsDataModule,
    EpochSeededSampler,
    ToyHeteroscedasticDataModule,
    UCIDataModule,
    toy_mean,
)

SHARED_UCI = Path(__file__).resolve().parents[2] / "shared" / "data" / "uci"
DATASETS = ("boston", "concrete", "energy", "power", "protein", "wine")


@pytest.fixture(scope="module")
def uci_root() -> Path:
    """The shared UCI data; under CI its absence fails the tests instead of skipping them."""
    if not SHARED_UCI.is_dir():
        if os.environ.get("CI"):
            pytest.fail(f"UCI data expected at {SHARED_UCI} (CI is set, so this is an error)")
        pytest.skip(f"UCI data not found at {SHARED_UCI}")
    return SHARED_UCI


# ---- the shared UCI data --------------------------------------------------------------------


@pytest.mark.parametrize("name", DATASETS)
def test_uci_split_zero_against_raw_files(uci_root, name):
    folder = uci_root / name
    raw = np.loadtxt(folder / "data.txt")
    features = np.loadtxt(folder / "index_features.txt", dtype=int, ndmin=1)
    target = int(np.loadtxt(folder / "index_target.txt"))
    train = np.loadtxt(folder / "index_train_0.txt", dtype=int)
    test = np.loadtxt(folder / "index_test_0.txt", dtype=int)

    dm = UCIDataModule(str(uci_root), name, split=0)
    # Readable straight after construction, before setup().
    assert dm.in_features == len(features)
    assert dm.num_train == len(train) and dm.num_test == len(test) and dm.num_val == 0
    assert dm.n_splits == int(np.loadtxt(folder / "n_splits.txt"))
    assert dm.target_loc == pytest.approx(raw[train, target].mean(), rel=1e-12)
    assert dm.target_scale == pytest.approx(raw[train, target].std(), rel=1e-12)
    np.testing.assert_allclose(dm.x_loc.numpy(), raw[np.ix_(train, features)].mean(0), rtol=1e-6)

    dm.setup("fit")
    x_train, y_train = dm.train_dataset.tensors
    assert x_train.dtype == y_train.dtype == torch.float32
    assert x_train.shape == (len(train), len(features)) and y_train.shape == (len(train),)
    # Targets stay in their original units (DVIRegressor standardises them with the statistics).
    np.testing.assert_allclose(y_train.double().numpy(), raw[train, target], rtol=1e-6)
    x_test, y_test = dm.test_dataset.tensors
    np.testing.assert_allclose(y_test.double().numpy(), raw[test, target], rtol=1e-6)
    np.testing.assert_allclose(
        x_test.double() * dm.x_scale.double() + dm.x_loc.double(),
        raw[np.ix_(test, features)],
        rtol=1e-5,
        atol=1e-3,
    )


def test_uci_validation_carve_out_is_seeded_and_disjoint(uci_root):
    dm = UCIDataModule(str(uci_root), "boston", split=3, val_fraction=0.1, seed=5)
    assert dm.num_train + dm.num_val == 455 and dm.num_val == 46
    again = UCIDataModule(str(uci_root), "boston", split=3, val_fraction=0.1, seed=5)
    other = UCIDataModule(str(uci_root), "boston", split=3, val_fraction=0.1, seed=6)
    assert torch.equal(dm.val_dataset.tensors[1], again.val_dataset.tensors[1])
    assert not torch.equal(dm.val_dataset.tensors[1], other.val_dataset.tensors[1])
    # Statistics come from the rows trained on, not the validation rows.
    y_train = dm.train_dataset.tensors[1].double()
    assert dm.target_loc == pytest.approx(y_train.mean().item(), rel=1e-6)
    rows = {tuple(r.tolist()) for r in dm.train_dataset.tensors[0]}
    assert not rows & {tuple(r.tolist()) for r in dm.val_dataset.tensors[0]}


def test_uci_split_out_of_range_and_loaders(uci_root):
    with pytest.raises(ValueError, match=r"split 20 is out of range.*20 splits"):
        _ = UCIDataModule(str(uci_root), "boston", split=20).num_train
    dm = UCIDataModule(str(uci_root), "energy", batch_size=64)
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (64, 8) and y.shape == (64,)
    assert dm.val_dataloader() == []
    assert len(dm.predict_dataloader().dataset) == dm.num_test


# ---- synthetic datasets in the UCI layout, for the error cases -------------------------------


def write_uci(
    root: Path,
    name: str = "tiny",
    rows: str | None = None,
    features: str = "0\n1\n",
    target: str = "2\n",
    splits: tuple[tuple[str, str], ...] = (("0\n1\n2\n3\n", "4\n5\n"), ("2\n3\n4\n5\n", "0\n1\n")),
    n_splits: str | None = None,
) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    default_rows = "".join(f"{i} {10 - i * 0.5} {2 * i + 1}\n" for i in range(6))
    (folder / "data.txt").write_text(default_rows if rows is None else rows)
    (folder / "index_features.txt").write_text(features)
    (folder / "index_target.txt").write_text(target)
    for k, (train, test) in enumerate(splits):
        (folder / f"index_train_{k}.txt").write_text(train)
        (folder / f"index_test_{k}.txt").write_text(test)
    if n_splits is not None:
        (folder / "n_splits.txt").write_text(n_splits)
    return folder


def load(root: Path, name: str = "tiny", **kwargs) -> UCIDataModule:
    dm = UCIDataModule(str(root), name, **kwargs)
    dm.setup("fit")
    return dm


def test_synthetic_dataset_loads(tmp_path):
    write_uci(tmp_path)
    dm = load(tmp_path)
    assert dm.n_splits == 2  # counted from the index_train_K files
    assert (dm.in_features, dm.num_train, dm.num_test) == (2, 4, 2)
    assert dm.target_loc == pytest.approx(4.0) and dm.target_scale == pytest.approx(
        np.std([1, 3, 5, 7])
    )
    raw = load(tmp_path, split=1, standardize=False)
    assert raw.target_loc == 0.0 and raw.target_scale == 1.0
    assert torch.equal(raw.test_dataset.tensors[1], torch.tensor([1.0, 3.0]))
    assert torch.equal(raw.x_scale, torch.ones(2))


def test_constant_column_gets_unit_scale(tmp_path):
    rows = "".join(f"{i} 7.3 {i * i}\n" for i in range(6))
    write_uci(tmp_path, rows=rows, splits=(("0\n1\n2\n3\n", "4\n5\n"),), n_splits="1\n")
    dm = load(tmp_path)
    assert dm.x_scale[1].item() == 1.0
    x = dm.train_dataset.tensors[0]
    assert torch.isfinite(x).all() and torch.equal(x[:, 1], torch.zeros(4))


def test_float_written_integer_indices_are_accepted(tmp_path):
    write_uci(
        tmp_path, features="0.0 1.0\n", target="2.0\n", splits=(("0\n1\n2\n3\n", "4.0\n5\n"),)
    )
    assert load(tmp_path).num_test == 2


@pytest.mark.parametrize(
    ("layout", "error", "message"),
    [
        ({"rows": "1 2 3\n4 x 6\n"}, ValueError, r"data\.txt is not a rectangular numeric table"),
        ({"rows": "1 2 3\n4 5\n6 7 8\n"}, ValueError, r"data\.txt is not a rectangular"),
        ({"rows": ""}, ValueError, r"data\.txt holds no data"),
        (
            {"rows": "".join(f"{i} 1 {'nan' if i == 3 else i}\n" for i in range(6))},
            ValueError,
            r"NaN or infinite values, e\.g\. rows \[3\]",
        ),
        (
            {"splits": (("0\n1\n9\n", "4\n5\n"),)},
            ValueError,
            r"index_train_0\.txt holds index 9 out of range for 6 rows",
        ),
        ({"splits": (("0\n1\n-1\n", "4\n5\n"),)}, ValueError, "out of range"),
        ({"splits": (("0\n1.5\n", "4\n5\n"),)}, ValueError, r"non-integer index: 1\.5"),
        (
            {"splits": (("0\nabc\n", "4\n5\n"),)},
            ValueError,
            r"index_train_0\.txt is not a list of integer",
        ),
        (
            {"splits": (("0\n1\n4\n", "4\n5\n"),)},
            ValueError,
            r"1 rows are in both the train and test",
        ),
        ({"splits": (("0\n1\n1\n", "4\n5\n"),)}, ValueError, "repeats index 1"),
        ({"splits": (("", "4\n5\n"),)}, ValueError, "holds no indices"),
        (
            {"features": "0\n3\n"},
            ValueError,
            r"index_features\.txt holds index 3 out of range for 3 columns",
        ),
        ({"target": "1\n"}, ValueError, "also listed as a feature"),
        ({"target": "0\n1\n"}, ValueError, "must hold one column index"),
        ({"n_splits": "two\n"}, ValueError, "one positive integer"),
        ({"n_splits": "3\n"}, FileNotFoundError, r"index_train_2\.txt"),
    ],
)
def test_corrupt_layouts_raise_clear_errors(tmp_path, layout, error, message):
    write_uci(tmp_path, **layout)
    split = 2 if layout.get("n_splits") == "3\n" else 0
    with pytest.raises(error, match=message):
        load(tmp_path, split=split)


@pytest.mark.parametrize(
    "missing",
    ["data.txt", "index_features.txt", "index_target.txt", "index_test_0.txt", "index_train_0.txt"],
)
def test_missing_files_are_named(tmp_path, missing):
    folder = write_uci(tmp_path, n_splits="2\n")
    (folder / missing).unlink()
    with pytest.raises(FileNotFoundError, match=missing.replace(".", r"\.")):
        load(tmp_path)


def test_missing_directories_and_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="UCI data directory not found"):
        _ = UCIDataModule(str(tmp_path / "nowhere"), "tiny").in_features
    write_uci(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"dataset folder not found.*\['tiny'\]"):
        _ = UCIDataModule(str(tmp_path), "boston").num_train
    with pytest.raises(ValueError, match=r"split 2 is out of range: tiny has 2 splits"):
        load(tmp_path, split=2)
    for fraction in (1.0, -0.1, float("nan")):
        with pytest.raises(ValueError, match="val_fraction"):
            UCIDataModule(str(tmp_path), "tiny", val_fraction=fraction)
    with pytest.raises(ValueError, match="leaves no training rows"):
        load(tmp_path, val_fraction=0.9)
    with pytest.raises(ValueError, match="folder name"):
        UCIDataModule(str(tmp_path), "../tiny")
    with pytest.raises(ValueError, match="batch_size"):
        UCIDataModule(str(tmp_path), "tiny", batch_size=0)
    with pytest.raises(ValueError, match="split must be"):
        UCIDataModule(str(tmp_path), "tiny", split=-1)


def test_tiny_val_fraction_still_gives_one_validation_row(tmp_path):
    write_uci(tmp_path)
    dm = load(tmp_path, val_fraction=0.01)
    assert (dm.num_train, dm.num_val) == (3, 1)
    assert len(dm.val_dataloader().dataset) == 1


# ---- toy --------------------------------------------------------------------------------------


def test_toy_module_attributes_splits_and_grid():
    dm = ToyHeteroscedasticDataModule(num_train=50, num_val=20, num_test=30, batch_size=16, seed=3)
    assert (dm.in_features, dm.num_train, dm.target_loc, dm.target_scale) == (1, 50, 0.0, 1.0)
    assert torch.equal(dm.x_loc, torch.zeros(1)) and torch.equal(dm.x_scale, torch.ones(1))
    dm.setup("fit")
    x_train, y_train = dm.train_dataset.tensors
    assert x_train.shape == (50, 1) and y_train.shape == (50,) and y_train.dtype == torch.float32
    assert len(dm.val_dataset) == 20 and len(dm.test_dataset) == 30
    assert (x_train.abs() <= 0.5).all()
    # Independent draws per split, reproducible from the seed.
    assert not torch.equal(dm.val_dataset.tensors[0][:20], x_train[:20])
    same = ToyHeteroscedasticDataModule(num_train=50, num_val=20, num_test=30, seed=3)
    assert torch.equal(same.train_dataset.tensors[1], y_train)
    x_grid, f_grid = dm.predict_dataloader().dataset.tensors
    assert x_grid.shape == (200, 1) and x_grid[0].item() == -0.5 and x_grid[-1].item() == 0.5
    torch.testing.assert_close(f_grid, toy_mean(x_grid[:, 0]))
    on_test = ToyHeteroscedasticDataModule(num_train=5, num_val=0, num_test=7, predict_on="test")
    assert len(on_test.predict_dataloader().dataset) == 7 and on_test.val_dataloader() == []


def test_the_toy_data_declare_their_truth_and_other_data_do_not():
    from lightning_dvi.data import KnownTruth, toy_noise_std

    toy = ToyHeteroscedasticDataModule(num_train=5)
    assert isinstance(toy, KnownTruth) and not isinstance(DigitsDataModule(), KnownTruth)
    x = torch.linspace(-0.5, 0.5, 11, dtype=torch.float64)
    mean, std = toy.true_mean_and_noise_std(x)
    torch.testing.assert_close(mean, toy_mean(x))
    torch.testing.assert_close(std, toy_noise_std(x))


def test_toy_module_rejects_bad_arguments():
    for kwargs in (
        {"num_train": 0},
        {"num_val": -1},
        {"predict_on": "train"},
        {"num_grid": 1},
        {"batch_size": 0},
    ):
        with pytest.raises(ValueError):
            ToyHeteroscedasticDataModule(**kwargs)


def test_training_order_is_seeded_per_epoch():
    dm = ToyHeteroscedasticDataModule(num_train=40, batch_size=40, seed=1)
    loader = dm.train_dataloader()
    first, second = (next(iter(loader))[1] for _ in range(2))
    assert not torch.equal(first, second)  # a new permutation each pass
    sampler = loader.sampler
    assert isinstance(sampler, EpochSeededSampler)
    sampler.set_epoch(1)
    assert torch.equal(next(iter(loader))[1], second)  # epoch 1's order, whatever came before
    fresh = ToyHeteroscedasticDataModule(num_train=40, batch_size=40, seed=1).train_dataloader()
    fresh.sampler.set_epoch(1)
    assert torch.equal(next(iter(fresh))[1], second)


# ---- digits -----------------------------------------------------------------------------------


def test_digits_module():
    dm = DigitsDataModule(seed=2)
    assert (dm.in_features, dm.num_classes) == (64, 10)
    assert dm.num_train + dm.num_val + dm.num_test == 1797
    assert (dm.num_val, dm.num_test) == (180, 359)
    x, y = dm.train_dataset.tensors
    assert x.dtype == torch.float32 and y.dtype == torch.long and torch.isfinite(x).all()
    assert x.double().mean(0).abs().max().item() < 1e-5
    assert dm.x_scale.shape == (64,) and (dm.x_scale > 0).all()
    # Stratified: every class is in every split in nearly equal proportion.
    for dataset in (dm.train_dataset, dm.val_dataset, dm.test_dataset):
        counts = torch.bincount(dataset.tensors[1], minlength=10).double()
        assert counts.min() / counts.max() > 0.85
    batch_x, batch_y = next(iter(dm.test_dataloader()))
    assert batch_x.shape == (128, 64) and batch_y.shape == (128,)
    no_val = DigitsDataModule(val_fraction=0.0)
    assert no_val.num_val == 0 and no_val.val_dataloader() == []
    for kwargs in (
        {"val_fraction": 1.0},
        {"test_fraction": 0.0},
        {"val_fraction": 0.5, "test_fraction": 0.5},
    ):
        with pytest.raises(ValueError, match="fraction"):
            DigitsDataModule(**kwargs)


# ---- integration: LightningCLI's parser and a short Trainer run -------------------------------


def test_constructors_are_jsonargparse_friendly(tmp_path):
    from jsonargparse import ArgumentParser

    for cls, args in (
        (ToyHeteroscedasticDataModule, ["--data.num_train=20"]),
        (
            UCIDataModule,
            [f"--data.data_dir={tmp_path}", "--data.dataset=tiny", "--data.val_fraction=0.2"],
        ),
        (DigitsDataModule, ["--data.seed=4"]),
    ):
        parser = ArgumentParser(exit_on_error=False)
        parser.add_class_arguments(cls, "data")
        config = parser.parse_args(args)
        instantiate = getattr(parser, "instantiate", None) or parser.instantiate_classes
        assert isinstance(instantiate(config).data, cls)


class _Linear(L.LightningModule):
    def __init__(self, in_features: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(in_features, 1)
        self.validated = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), y)

    def validation_step(self, batch, batch_idx):
        self.validated += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


@pytest.mark.parametrize("val_fraction", [0.0, 0.2])
def test_trainer_runs_with_and_without_validation(uci_root, val_fraction):
    dm = UCIDataModule(str(uci_root), "energy", val_fraction=val_fraction, batch_size=128)
    model = _Linear(dm.in_features)
    trainer = L.Trainer(
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    trainer.fit(model, dm)
    assert (model.validated > 0) == (val_fraction > 0)
