"""CSVDataModule: reading, splits, training-statistics standardisation, CLI linking, a fit via the recipe."""

import csv
import runpy
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dvi import DVIClassifier, DVIRegressor
from lightning_dvi.cli import cli
from lightning_dvi.data import CSVDataModule, read_tabular

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "csv_regression.yaml"


def _table(num_rows=50, seed=1):
    """Columns id (0..N-1, identifies a row), a, b (inputs on different scales), y, label."""
    rng = np.random.default_rng(seed)
    ids = np.arange(num_rows, dtype=float)
    a = rng.normal(100.0, 15.0, num_rows)
    b = rng.normal(-3.0, 0.2, num_rows)
    y = 2.0 * a - 40.0 * b + rng.normal(0.0, 5.0, num_rows)
    label = (a > 100).astype(int) + (b > -3).astype(int)
    return {"id": ids, "a": a, "b": b, "y": y, "label": label}


def _write_csv(path, columns, rows=None):
    names = list(columns)
    rows = range(len(columns[names[0]])) if rows is None else rows
    lines = [",".join(names)]
    lines += [",".join(repr(float(columns[n][i])) for n in names) for i in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def _raw(dataset, dm):
    """Undo the standardisation of a split's inputs."""
    return dataset.tensors[0].double() * dm.x_scale.double() + dm.x_loc.double()


def test_split_by_fractions_is_seeded_disjoint_and_standardised_with_training_statistics(tmp_path):
    columns = _table()
    path = _write_csv(tmp_path / "data.csv", columns)
    dm = CSVDataModule(
        str(path), target="y", features=["id", "a", "b"], val_fraction=0.2, test_fraction=0.1
    )
    assert (dm.in_features, dm.num_train, dm.num_val, dm.num_test) == (3, 35, 10, 5)
    ids = {
        split: _raw(getattr(dm, f"{split}_dataset"), dm)[:, 0].round().long().tolist()
        for split in ("train", "val", "test")
    }
    assert sorted(ids["train"] + ids["val"] + ids["test"]) == list(range(50))
    train = np.array(ids["train"])
    # Independent oracle: numpy statistics of the training rows of the original columns.
    for j, name in enumerate(["id", "a", "b"]):
        assert float(dm.x_loc[j]) == pytest.approx(columns[name][train].mean(), rel=1e-6)
        assert float(dm.x_scale[j]) == pytest.approx(columns[name][train].std(), rel=1e-6)
    assert dm.target_loc == pytest.approx(columns["y"][train].mean(), rel=1e-12)
    assert dm.target_scale == pytest.approx(columns["y"][train].std(), rel=1e-12)
    # Every split maps back to its own rows of the file, inputs and target.
    for split in ("train", "val", "test"):
        dataset = getattr(dm, f"{split}_dataset")
        rows = np.array(ids[split])
        np.testing.assert_allclose(_raw(dataset, dm)[:, 1].numpy(), columns["a"][rows], rtol=1e-6)
        # targets stay raw, exactly the file's float64 values (the regressor standardises them
        # with target_loc/target_scale in float64)
        assert dataset.tensors[1].dtype == torch.float64
        np.testing.assert_array_equal(dataset.tensors[1].numpy(), columns["y"][rows])
    # Same seed, same split; another seed, another split.
    again = CSVDataModule(str(path), target="y", val_fraction=0.2, test_fraction=0.1)
    other = CSVDataModule(str(path), target="y", val_fraction=0.2, test_fraction=0.1, seed=1)
    assert torch.equal(again.test_dataset.tensors[1], dm.test_dataset.tensors[1])
    assert not torch.equal(other.test_dataset.tensors[1], dm.test_dataset.tensors[1])


def test_default_features_are_every_other_column_in_file_order(tmp_path):
    columns = _table()
    path = _write_csv(tmp_path / "data.csv", {k: columns[k] for k in ("a", "y", "b")})
    dm = CSVDataModule(str(path), target="y", val_fraction=0.0)
    assert dm.feature_names == ["a", "b"]
    assert (dm.num_train, dm.num_val, dm.num_test) == (50, 0, 0)
    assert dm.val_dataloader() == [] and dm.test_dataloader() == []
    x = dm.train_dataset.tensors[0].double()
    torch.testing.assert_close(x.mean(0), torch.zeros(2, dtype=torch.float64), atol=1e-6, rtol=0)
    torch.testing.assert_close(x.std(0, correction=0), torch.ones(2, dtype=torch.float64))


def test_separate_files_use_only_the_training_file_for_statistics(tmp_path):
    columns = _table(60)
    train = _write_csv(tmp_path / "train.csv", columns, range(0, 40))
    val = _write_csv(tmp_path / "val.csv", columns, range(40, 50))
    test = _write_csv(tmp_path / "test.tsv", columns, range(50, 60))
    test.write_text(test.read_text().replace(",", "\t"))
    dm = CSVDataModule(
        str(train), target="y", features=["a", "b"], val_path=str(val), test_path=str(test)
    )
    assert (dm.num_train, dm.num_val, dm.num_test) == (40, 10, 10)
    assert dm.target_loc == pytest.approx(columns["y"][:40].mean(), rel=1e-12)
    assert float(dm.x_loc[0]) == pytest.approx(columns["a"][:40].mean(), rel=1e-6)
    np.testing.assert_allclose(
        _raw(dm.test_dataset, dm)[:, 0].numpy(), columns["a"][50:], rtol=1e-6
    )


def test_unused_text_columns_are_ignored_when_features_are_listed(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("name,x,y\nann,1,2\nbob,2,4\ncy,3,7\n")
    dm = CSVDataModule(str(path), target="y", features=["x"], val_fraction=0, standardize=False)
    assert dm.train_dataset.tensors[0].flatten().tolist() == [1.0, 2.0, 3.0]
    assert (dm.target_loc, dm.target_scale) == (0.0, 1.0)
    with pytest.raises(
        ValueError, match=r"line 2, column 'name': non-numeric value 'ann'.*features"
    ):
        _ = CSVDataModule(str(path), target="y", val_fraction=0).in_features


def test_classification_labels_and_links(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dvi"])
    columns = _table(40)
    path = _write_csv(tmp_path / "data.csv", {k: columns[k] for k in ("a", "b", "label")})
    dm = CSVDataModule(str(path), target="label", task="classification", test_fraction=0.25)
    assert dm.num_classes == int(columns["label"].max()) + 1 == 3
    assert dm.train_dataset.tensors[1].dtype == torch.long
    assert not hasattr(dm, "target_loc")  # so the CLI skips the regression links
    assert (
        CSVDataModule(str(path), target="label", task="classification", num_classes=5).num_classes
        == 5
    )
    regression = CSVDataModule(str(path), target="label")
    assert not hasattr(regression, "num_classes")

    run = cli(
        [
            "--model", "DVIClassifier", "--model.hidden", "[4]",
            "--data", "CSVDataModule", "--data.path", str(path), "--data.target", "label",
            "--data.task", "classification", "--trainer.logger", "false",
        ],
        run=False,
    )  # fmt: skip
    assert isinstance(run.model, DVIClassifier)
    assert (run.model.num_classes, run.model.hparams.in_features) == (3, 2)
    assert run.model.num_data == run.datamodule.num_train


def test_numpy_files(tmp_path):
    columns = _table(30)
    table = np.stack([columns["a"], columns["b"], columns["y"]], axis=1)
    np.save(tmp_path / "data.npy", table)
    dm = CSVDataModule(str(tmp_path / "data.npy"), target=2, val_fraction=0)
    assert dm.feature_names == ["0", "1"]
    assert dm.target_loc == pytest.approx(columns["y"].mean(), rel=1e-12)
    np.savez(tmp_path / "data.npz", a=columns["a"], b=columns["b"], y=columns["y"])
    dm = CSVDataModule(str(tmp_path / "data.npz"), target="y", features=["b"], val_fraction=0)
    assert float(dm.x_loc[0]) == pytest.approx(columns["b"].mean(), rel=1e-6)
    names, values, row_name = read_tabular(tmp_path / "data.npz", ["y", "a"])
    assert names == ["y", "a"] and values.shape == (30, 2) and row_name(3) == "row 3"


def test_parquet_columns_keep_their_types_and_nulls_are_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "data.parquet"
    table = {"x": [1.0, 2.0, 3.0], "n": [1, 2, 3], "y": [2.0, 4.0, 7.0], "k": ["a", "b", "a"]}
    pq.write_table(pa.table(table), path)
    dm = CSVDataModule(str(path), target="y", val_fraction=0, standardize=False, drop_columns=["k"])
    assert dm.feature_names == ["x", "n"]
    assert dm.train_dataset.tensors[0].tolist() == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
    clf = CSVDataModule(str(path), target="k", task="classification", features=["x"],
                        val_fraction=0)  # fmt: skip
    assert clf.labels == ["a", "b"] and clf.train_dataset.tensors[1].tolist() == [0, 1, 0]
    pq.write_table(pa.table({"x": [1.0, None, 3.0], "y": [1.0, 2.0, 3.0]}), path)
    with pytest.raises(ValueError, match=r"data.parquet, row 1, column 'x': missing value"):
        CSVDataModule(str(path), target="y", val_fraction=0).setup()
    pq.write_table(pa.table({"x": ["1.5", "two"], "y": [1.0, 2.0]}), path)
    with pytest.raises(ValueError, match=r"row 1, column 'x': non-numeric value 'two'"):
        CSVDataModule(str(path), target="y", val_fraction=0).setup()


def test_predict_path_without_target(tmp_path):
    columns = _table(20)
    train = _write_csv(tmp_path / "train.csv", columns)
    new = _write_csv(tmp_path / "new.csv", {k: columns[k] for k in ("b", "a")}, range(5))
    dm = CSVDataModule(str(train), target="y", features=["a", "b"], predict_path=str(new))
    (batch,) = list(dm.predict_dataloader())
    assert len(batch) == 1  # inputs only
    np.testing.assert_allclose(
        (batch[0].double() * dm.x_scale.double() + dm.x_loc.double())[:, 0].numpy(),
        columns["a"][:5],
        rtol=1e-6,
    )


def _labelled(path, labels):
    rows = [f"{i % 7}.5,{label}" for i, label in enumerate(labels)]
    path.write_text("a,y\n" + "\n".join(rows) + "\n")
    return str(path)


@pytest.mark.parametrize("split", ["val_path", "test_path", "predict_path"])
def test_a_label_only_in_another_file_than_the_training_file_is_named_with_its_file(
    tmp_path, split
):
    """Issue 44, item 4: the classes are the training file's labels; a label seen only in a
    validation, test or predict file was a class no training row reaches (an untrained
    ``prob_bird``). Now it is an error naming every such label, its first line and its file."""
    train = _labelled(tmp_path / "train.csv", ["cat", "dog"] * 4)
    other = _labelled(tmp_path / "other.csv", ["cat", "bird", "dog", "fish", "bird"])
    with pytest.raises(ValueError) as info:
        CSVDataModule(train, target="y", task="classification", **{split: other}).setup()
    message = str(info.value)
    assert message.startswith(
        f"{tmp_path / 'other.csv'}, line 3, column 'y': class labels 'bird' (line 3), 'fish' "
        f"(line 5) are not in the training file {tmp_path / 'train.csv'} (its labels: ['cat', "
        "'dog'])"
    ), message
    assert '--data.labels \'["cat", "dog", "bird", "fish"]\'' in message
    # Declared classes fix the set and the order; a declared class may lack training rows.
    dm = CSVDataModule(train, target="y", task="classification",
                       labels=["fish", "dog", "cat", "bird"], **{split: other})  # fmt: skip
    assert dm.labels == ["fish", "dog", "cat", "bird"] and dm.num_classes == 4
    assert sorted(set(dm.train_dataset.tensors[1].tolist())) == [1, 2]
    # An undeclared label is still an error naming it and its file, wherever it is.
    with pytest.raises(ValueError, match=r"other\.csv, line 5, column 'y': class label 'fish' is "
                       r"not one of labels=\['bird', 'cat', 'dog'\]$"):  # fmt: skip
        CSVDataModule(train, target="y", task="classification", labels=["bird", "cat", "dog"],
                      **{split: other}).setup()  # fmt: skip


def test_labels_missing_from_several_files_are_all_named_and_num_classes_declares_them(tmp_path):
    train = _labelled(tmp_path / "train.csv", ["0", "1", "0", "1", "0"])
    test = _labelled(tmp_path / "test.csv", ["1", "2", "0"])
    new = _labelled(tmp_path / "new.csv", ["3", "0"])
    with pytest.raises(ValueError) as info:
        CSVDataModule(train, target="y", task="classification", test_path=test,
                      predict_path=new).setup()  # fmt: skip
    message = str(info.value)
    assert "test.csv, line 3, column 'y': class label 2 is not in the training file" in message
    assert f"; so is 3 (line 2) in {tmp_path / 'new.csv'}:" in message
    assert "labels=[0, 1, 2, 3] (--data.labels '[0, 1, 2, 3]'" in message
    dm = CSVDataModule(train, target="y", task="classification", test_path=test,
                       predict_path=new, num_classes=4)  # fmt: skip
    assert dm.labels == [0, 1, 2, 3] and dm.test_dataset.tensors[1].tolist() == [1, 2, 0]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(target=["y", "z"]), "must name one column"),
        (dict(target="y", features=["a", "y"]), "also listed in features"),
        (dict(target="y", task="ordinal"), "task must be"),
        (dict(target="y", val_fraction=0.5, test_fraction=0.5), "must stay below 1"),
        (dict(target="y", num_classes=3), "num_classes is for task='classification'"),
        (dict(target="y", batch_size=0), "batch_size must be positive"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        CSVDataModule(str(tmp_path / "data.csv"), **kwargs)


def test_cli_fit_on_the_diabetes_csv_via_the_recipe(cli_workdir, monkeypatch, capsys):
    """Issue 14's acceptance, fit half: the committed recipe trains on the diabetes CSV and
    leaves a checkpoint that loads (the predict half compares its CSV with ``predictive``).

    The CLI runs in this process (README.md's CLI block runs the same three commands as
    processes): a fresh interpreter per command cost ~8 s of CPU in imports each."""
    tmp_path = cli_workdir
    maker = REPO / "recipes" / "make_diabetes_csv.py"
    monkeypatch.setattr(sys, "argv", [str(maker), "diabetes.csv"])
    runpy.run_path(str(maker), run_name="__main__")
    capsys.readouterr()
    cli(
        ["fit", "--config", str(RECIPE), "--data.path", "diabetes.csv", "--trainer.max_epochs", "2"]
    )
    stdout = capsys.readouterr().out
    run_dir = tmp_path / "runs" / "csv_regression" / "lightning_logs" / "version_0"
    checkpoint = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint.is_file(), stdout[-2000:]
    assert "test/rmse" in stdout
    model = DVIRegressor.load_from_checkpoint(checkpoint, map_location="cpu")
    dm = CSVDataModule(str(tmp_path / "diabetes.csv"), target="target", test_fraction=0.2)
    assert model.hparams.in_features == dm.in_features == 10
    assert model.num_data == dm.num_train == 310
    # The checkpoint carries the training-target standardisation of the data module.
    assert float(model.target_loc) == pytest.approx(dm.target_loc, rel=1e-6)
    assert float(model.target_scale) == pytest.approx(dm.target_scale, rel=1e-6)
    assert dm.target_scale > 50  # original units: disease progression, std about 77
    mean, var = model.predictive(dm.test_dataset.tensors[0])
    assert mean.shape == (dm.num_test,) and bool((var > 0).all())
    # Predict half: `predict` with that checkpoint writes a CSV whose rows (the test split, in
    # order) match DVIRegressor.predictive to 1e-6.
    cli(
        ["predict", "--config", str(RECIPE), "--data.path", "diabetes.csv",
         "--ckpt_path", str(checkpoint)]
    )  # fmt: skip
    stdout = capsys.readouterr().out
    written = sorted(tmp_path.glob("runs/csv_regression/**/predictions.csv"))
    assert written, stdout[-2000:]
    with written[-1].open() as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == dm.num_test
    column = {k: torch.tensor([float(r[k]) for r in rows], dtype=torch.float64) for k in rows[0]}
    torch.testing.assert_close(column["mean"], mean.double(), rtol=0, atol=1e-6)
    torch.testing.assert_close(column["std"], var.double().sqrt(), rtol=0, atol=1e-6)


def test_a_bad_file_through_the_cli_exits_2_naming_file_row_and_column(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dvi"])
    (tmp_path / "bad.csv").write_text("a,b,target\n1,2,3\n4,oops,6\n")
    with pytest.raises(SystemExit) as exit_info:
        cli(["--config", str(RECIPE), "--data.path", "bad.csv"], run=False)
    assert exit_info.value.code == 2
    message = capsys.readouterr().err
    assert "bad.csv, line 3, column 'b': non-numeric value 'oops'" in message
    assert "Traceback" not in message
