"""The bad-input catalogue of docs/errors.md: each entry raises an error that names the problem."""

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dvi import Gaussian
from lightning_dvi.data import CSVDataModule, UCIDataModule
from lightning_dvi.likelihoods import Categorical, HeteroscedasticGaussian
from lightning_dvi.nn import BayesConv2d, mlp
from lightning_dvi.objective import elbo
from lightning_dvi.priors import EmpiricalBayes

DOC = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def _elbo(x, y, net=None, likelihood=None):
    net = net or mlp(3, [4], 2)
    return elbo(net, likelihood or HeteroscedasticGaussian(), EmpiricalBayes(), x, y, num_data=10)


def _uci(tmp_path, files):
    folder = tmp_path / "toy"
    folder.mkdir()
    for name, text in files.items():
        (folder / name).write_text(text)
    return UCIDataModule(str(tmp_path), "toy").in_features


GOOD = {
    "data.txt": "1 2 3\n4 5 6\n7 8 9\n",
    "index_features.txt": "0\n1\n",
    "index_target.txt": "2\n",
    "index_train_0.txt": "0\n1\n",
    "index_test_0.txt": "2\n",
}


def _csv(tmp_path, text, name="data.csv", **kwargs):
    path = tmp_path / name
    path.write_text(text)
    return CSVDataModule(str(path), **{"target": "y", **kwargs}).num_train


CSV_GOOD = "a,b,y\n1,2,3\n4,5,6\n7,8,9\n"

CATALOGUE = [
    (
        "nan_input",
        lambda t: mlp(3, [4], 2)(torch.tensor([[0.0, float("nan"), 0.0]])),
        ValueError,
        "input contains NaN or Inf",
    ),
    (
        "inf_input",
        lambda t: mlp(3, [4], 2)(torch.tensor([[0.0, float("inf"), 0.0]])),
        ValueError,
        "input contains NaN or Inf",
    ),
    (
        "nan_target",
        lambda t: _elbo(torch.zeros(2, 3), torch.tensor([0.0, float("nan")])),
        ValueError,
        "targets contain NaN or Inf",
    ),
    (
        "input_width",
        lambda t: mlp(3, [4], 2)(torch.zeros(2, 5)),
        ValueError,
        "expected input with last dimension 3",
    ),
    (
        "target_shape",
        lambda t: _elbo(torch.zeros(2, 3), torch.zeros(3)),
        ValueError,
        "do not match the batch",
    ),
    (
        "output_width",
        lambda t: _elbo(torch.zeros(2, 3), torch.zeros(2), net=mlp(3, [4], 1)),
        ValueError,
        "consumes 2 network output(s)",
    ),
    (
        "dtype_mismatch",
        lambda t: mlp(3, [4], 2)(torch.zeros(2, 3, dtype=torch.float64)),
        ValueError,
        "but the input is torch.float64",
    ),
    (
        "integer_input",
        lambda t: mlp(3, [4], 2)(torch.zeros(2, 3, dtype=torch.long)),
        ValueError,
        "must be a floating tensor",
    ),
    ("empty_batch", lambda t: _elbo(torch.zeros(0, 3), torch.zeros(0)), ValueError, "empty batch"),
    (
        "label_range",
        lambda t: _elbo(
            torch.zeros(2, 3), torch.tensor([0, 5]), net=mlp(3, [4], 3), likelihood=Categorical(3)
        ),
        ValueError,
        "labels out of range",
    ),
    (
        "label_float",
        lambda t: _elbo(
            torch.zeros(2, 3),
            torch.tensor([0.0, 1.5]),
            net=mlp(3, [4], 3),
            likelihood=Categorical(3),
        ),
        ValueError,
        "labels must be integers",
    ),
    (
        "unknown_mode",
        lambda t: mlp(3, [4], 2)(torch.zeros(1, 3), mode="exact"),
        ValueError,
        "unknown mode 'exact'",
    ),
    (
        "negative_variance",
        lambda t: Gaussian(torch.zeros(2), var=-torch.ones(2)),
        ValueError,
        "negative variances",
    ),
    (
        "gaussian_shapes",
        lambda t: Gaussian(torch.zeros(2, 3), var=torch.ones(2, 4)),
        ValueError,
        "does not match mean shape",
    ),
    (
        "conv_channels",
        lambda t: BayesConv2d(3, 4, 3)(torch.zeros(2, 1, 8, 8)),
        ValueError,
        "BayesConv2d expected 3 input channels, got 1",
    ),
    (
        "conv_not_4d",
        lambda t: BayesConv2d(1, 4, 3)(torch.zeros(2, 64), mode="diag"),
        ValueError,
        "expects an image batch [B, C, H, W] (4-D), got shape (2, 64)",
    ),
    (
        "uci_missing_folder",
        lambda t: UCIDataModule(str(t), "nope").in_features,
        FileNotFoundError,
        "dataset folder not found",
    ),
    (
        "uci_missing_file",
        lambda t: _uci(t, {k: v for k, v in GOOD.items() if k != "index_target.txt"}),
        FileNotFoundError,
        "index_target.txt",
    ),
    (
        "uci_corrupt",
        lambda t: _uci(t, {**GOOD, "data.txt": "1 2 3\n4 5 x\n7 8 9\n"}),
        ValueError,
        "is not a rectangular numeric table",
    ),
    (
        "uci_nan_row",
        lambda t: _uci(t, {**GOOD, "data.txt": "1 2 3\n4 nan 6\n7 8 9\n"}),
        ValueError,
        "NaN",
    ),
    (
        "uci_index_range",
        lambda t: _uci(t, {**GOOD, "index_train_0.txt": "0\n7\n"}),
        ValueError,
        "out of range",
    ),
    (
        "uci_overlap",
        lambda t: _uci(t, {**GOOD, "index_train_0.txt": "0\n1\n2\n"}),
        ValueError,
        "in both the train and test indices",
    ),
    (
        "csv_missing_file",
        lambda t: CSVDataModule(str(t / "nope.csv"), target="y").num_train,
        FileNotFoundError,
        "data file not found",
    ),
    (
        "csv_missing_column",
        lambda t: _csv(t, CSV_GOOD, target="price"),
        ValueError,
        "data.csv: no column 'price' (columns in the file: a, b, y)",
    ),
    (
        "csv_missing_feature",
        lambda t: _csv(t, CSV_GOOD, features=["a", "c"]),
        ValueError,
        "data.csv: no column 'c'",
    ),
    (
        "csv_empty_cell",
        lambda t: _csv(t, "a,b,y\n1,2,3\n4,,6\n"),
        ValueError,
        "data.csv, line 3, column 'b': empty cell",
    ),
    (
        "csv_nan",
        lambda t: _csv(t, "a,b,y\n1,2,3\n4,5,NaN\n"),
        ValueError,
        "data.csv, line 3, column 'y': NaN (not a finite number)",
    ),
    (
        "csv_non_numeric",
        lambda t: _csv(t, "a,b,y\n1,2,3\n4,five,6\n"),
        ValueError,
        "data.csv, line 3, column 'b': non-numeric value 'five'",
    ),
    (
        "csv_ragged_row",
        lambda t: _csv(t, "a,b,y\n1,2,3\n4,5\n"),
        ValueError,
        "data.csv, line 3: 2 cells, but the header has 3 columns",
    ),
    ("csv_empty_file", lambda t: _csv(t, ""), ValueError, "data.csv is empty"),
    ("csv_header_only", lambda t: _csv(t, "a,b,y\n"), ValueError, "has a header but no data rows"),
    (
        "csv_duplicate_column",
        lambda t: _csv(t, "a,a,y\n1,2,3\n"),
        ValueError,
        "data.csv, line 1: column 'a' appears twice",
    ),
    (
        "csv_label_not_integer",
        lambda t: _csv(t, "a,b,y\n1,2,0\n4,5,1.5\n", task="classification"),
        ValueError,
        "data.csv, line 3, column 'y': class label 1.5 is not an integer: class labels are "
        "integers or text",
    ),
    (
        "csv_label_not_listed",
        lambda t: _csv(t, "a,b,y\n1,2,a\n4,5,d\n", task="classification", labels=["a", "b"]),
        ValueError,
        "data.csv, line 3, column 'y': class label 'd' is not one of labels=['a', 'b']",
    ),
    (
        "csv_python_literal",
        lambda t: _csv(t, "a,b,y\n1,2,3\n1_000,5,6\n"),
        ValueError,
        "data.csv, line 3, column 'a': non-numeric value '1_000'",
    ),
    (
        "csv_float32_overflow",
        lambda t: _csv(t, "a,b,y\n1,2,3\n4,1e39,6\n", standardize=False),
        ValueError,
        "data.csv, line 3, column 'b': 1e+39 does not fit in float32",
    ),
    (
        "csv_encoding",
        lambda t: (
            (t / "data.csv").write_bytes(b"a,b,y\n1,2,3\n4,5,6\ncaf\xe9,7,8\n"),
            CSVDataModule(str(t / "data.csv"), target="y", id_columns=["a"]).num_train,
        ),
        ValueError,
        "data.csv, line 4: not valid utf-8 text",
    ),
    (
        "csv_unknown_encoding",
        lambda t: _csv(t, CSV_GOOD, encoding="klingon"),
        ValueError,
        "encoding: unknown text encoding 'klingon'",
    ),
    (
        "csv_missing_id_column",
        lambda t: _csv(t, CSV_GOOD, id_columns=["customer_id"]),
        ValueError,
        "data.csv: no column 'customer_id' (columns in the file: a, b, y)",
    ),
    (
        "parquet_unreadable",
        lambda t: (
            (t / "d.parquet").write_bytes(b"PAR1 not really"),
            CSVDataModule(str(t / "d.parquet"), target="y").num_train,
        ),
        ValueError,
        "d.parquet is not a readable Parquet file",
    ),
    (
        "csv_label_out_of_range",
        lambda t: _csv(t, "a,b,y\n1,2,0\n4,5,3\n", task="classification", num_classes=3),
        ValueError,
        "data.csv, line 3, column 'y': class label 3 is out of range for num_classes=3",
    ),
    (
        "csv_unsupported_type",
        lambda t: _csv(t, CSV_GOOD, name="data.xlsx"),
        ValueError,
        "unsupported file type '.xlsx'",
    ),
    (
        "npy_nan",
        lambda t: (
            np.save(t / "d.npy", np.array([[1.0, 2.0], [np.nan, 3.0]])),
            CSVDataModule(str(t / "d.npy"), target="1").num_train,
        ),
        ValueError,
        "d.npy, row 1, column '0': nan (not a finite number)",
    ),
]


@pytest.mark.parametrize(
    ("name", "call", "error", "match"), CATALOGUE, ids=[c[0] for c in CATALOGUE]
)
def test_catalogue_entry(name, call, error, match, tmp_path):
    with pytest.raises(error, match=re.escape(match)):
        call(tmp_path)


def test_every_catalogue_entry_and_cited_test_is_in_the_docs():
    doc = DOC.read_text()
    for name, _, _, match in CATALOGUE:
        assert f"`{name}`" in doc, f"docs/errors.md lacks catalogue entry {name}"
        assert match in doc, f"docs/errors.md lacks the message of {name}: {match!r}"
    tests_dir = Path(__file__).resolve().parent
    source = "\n".join(p.read_text() for p in tests_dir.glob("test_*.py"))
    for cited in set(re.findall(r"`(test_[a-z0-9_]+)`", doc)):
        assert f"def {cited}(" in source, f"docs/errors.md cites {cited}, which does not exist"
