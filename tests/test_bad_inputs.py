"""The bad-input catalogue of docs/errors.md: each entry raises an error that names the problem."""

import re
from pathlib import Path

import pytest
import torch

from lightning_dvi import Gaussian
from lightning_dvi.data import UCIDataModule
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
