"""LightningDataModule for UCI regression benchmarks in the standard split layout.

The layout (Hernández-Lobato & Adams, 2015; Gal & Ghahramani's splits) of ``<data_dir>/<dataset>/``:

* ``data.txt``: a whitespace-separated numeric table, one row per example;
* ``index_features.txt``, ``index_target.txt``: 0-based column indices of the inputs and target;
* ``index_train_K.txt``, ``index_test_K.txt``: 0-based row indices of split ``K``;
* ``n_splits.txt`` (optional): the number of splits.

The package ships no data: users name the directory.
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ._base import InMemoryDataModule, fit_standardizer

__all__ = ["UCIDataModule", "count_uci_splits", "read_indices", "read_table"]

_TRAIN_FILE = re.compile(r"index_train_(\d+)\.txt")


def _loadtxt(path: Path, ndmin: Literal[1, 2]) -> np.ndarray:
    # numpy warns on an empty file; callers turn emptiness into a ValueError naming the file.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return np.loadtxt(path, dtype=np.float64, ndmin=ndmin)


def read_table(path: Path) -> np.ndarray:
    """Read a whitespace-separated numeric table as float64 ``[rows, cols]``.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, for non-numeric entries, ragged rows or an empty file.
    """
    if not path.is_file():
        raise FileNotFoundError(f"missing data file: {path}")
    try:
        table = _loadtxt(path, ndmin=2)
    except ValueError as err:
        raise ValueError(f"{path} is not a rectangular numeric table: {err}") from None
    if table.size == 0:
        raise ValueError(f"{path} holds no data")
    return table


def read_indices(path: Path, *, size: int, what: str) -> np.ndarray:
    """Read 0-based integer indices from ``path`` and check them against ``[0, size)``.

    Integral values written as floats (``"13.0"``) are accepted.

    Args:
        path: a whitespace-separated list of indices.
        size: the exclusive upper bound.
        what: what the indices index (``"rows"``, ``"columns"``), for error messages.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, for an empty file, non-numeric, non-integer, repeated or
            out-of-range entries.
    """
    if not path.is_file():
        raise FileNotFoundError(f"missing index file: {path}")
    try:
        values = _loadtxt(path, ndmin=1).reshape(-1)
    except ValueError as err:
        raise ValueError(f"{path} is not a list of integer indices: {err}") from None
    if values.size == 0:
        raise ValueError(f"{path} holds no indices")
    bad = ~np.isfinite(values) | (values != np.round(values))
    if bad.any():
        raise ValueError(f"{path} holds a non-integer index: {values[bad][0]:g}")
    indices = values.astype(np.int64)
    out_of_range = (indices < 0) | (indices >= size)
    if out_of_range.any():
        raise ValueError(
            f"{path} holds index {indices[out_of_range][0]} out of range for {size} {what} "
            f"(valid: 0..{size - 1})"
        )
    unique, counts = np.unique(indices, return_counts=True)
    if (counts > 1).any():
        raise ValueError(f"{path} repeats index {unique[counts > 1][0]}")
    return indices


def count_uci_splits(folder: Path) -> int:
    """Number of splits in a dataset folder.

    Read from ``n_splits.txt`` if present, else the count of ``index_train_K.txt`` files.

    Raises:
        FileNotFoundError: if there is neither ``n_splits.txt`` nor any ``index_train_K.txt``.
        ValueError: if ``n_splits.txt`` does not hold one positive integer.
    """
    declared = folder / "n_splits.txt"
    if declared.is_file():
        text = declared.read_text().split()
        if len(text) != 1 or not text[0].isdigit() or int(text[0]) < 1:
            raise ValueError(f"{declared} must hold one positive integer, got {' '.join(text)!r}")
        return int(text[0])
    count = sum(1 for p in folder.iterdir() if _TRAIN_FILE.fullmatch(p.name))
    if count == 0:
        raise FileNotFoundError(f"no n_splits.txt and no index_train_K.txt files in {folder}")
    return count


@dataclass(frozen=True)
class _Statistics:
    """What the loaded split tells the model: sizes and the standardisation."""

    in_features: int
    target_loc: float
    target_scale: float
    x_loc: torch.Tensor
    x_scale: torch.Tensor


class UCIDataModule(InMemoryDataModule):
    """One split of a UCI regression dataset in the standard layout (see the module docstring).

    Inputs are standardised with the statistics of the training rows actually trained on (after
    the validation carve-out). Targets stay in their original units; their training mean and
    standard deviation are exposed as ``target_loc``/``target_scale``, which
    :class:`~lightning_dvi.DVIRegressor` standardises with (raw ``y`` in, original units out).
    Batches are ``(x [B, D] float32, y [B] float32)``. ``predict_dataloader`` yields the test set.

    Data are read on first use (``setup`` or any data attribute), so ``in_features``,
    ``num_train``, ``target_loc`` etc. are readable right after construction.

    Args:
        data_dir: directory holding one folder per dataset.
        dataset: folder name inside ``data_dir``, e.g. ``"boston"``; any folder in the layout works.
        split: which ``index_train_K`` / ``index_test_K`` pair to use.
        val_fraction: fraction of the training split held out (seeded) for validation; 0 means
            no validation.
        batch_size: mini-batch size for every loader.
        seed: seeds the validation carve-out and the training-set shuffling.
        standardize: standardise x with training statistics and expose the training statistics
            of y (else loc 0, scale 1 for both: no standardisation anywhere).

    Raises:
        FileNotFoundError: naming the missing directory or file.
        ValueError: for corrupt tables, NaN rows, bad indices (out of range, non-integer,
            repeated, overlapping train/test), a split out of range or a bad ``val_fraction``.

    Examples:
        >>> dm = UCIDataModule("/path/to/uci", "boston", split=0)  # doctest: +SKIP
        >>> dm.in_features, dm.num_train, dm.n_splits  # doctest: +SKIP
        (13, 455, 20)
    """

    def __init__(
        self,
        data_dir: str,
        dataset: str,
        split: int = 0,
        val_fraction: float = 0.0,
        batch_size: int = 100,
        seed: int = 0,
        standardize: bool = True,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed)
        if not dataset or Path(dataset).name != dataset or dataset in (".", ".."):
            raise ValueError(f"dataset must be a folder name inside data_dir, got {dataset!r}")
        if split < 0:
            raise ValueError(f"split must be >= 0, got {split}")
        if not (math.isfinite(val_fraction) and 0.0 <= val_fraction < 1.0):
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        self.data_dir = data_dir
        self.dataset = dataset
        self.split = split
        self.val_fraction = val_fraction
        self.standardize = standardize
        self._stats: _Statistics | None = None

    @property
    def folder(self) -> Path:
        """``<data_dir>/<dataset>``, checked to exist."""
        root = Path(self.data_dir).expanduser()
        if not root.is_dir():
            raise FileNotFoundError(f"UCI data directory not found: {root}")
        folder = root / self.dataset
        if not folder.is_dir():
            available = sorted(p.name for p in root.iterdir() if p.is_dir())
            raise FileNotFoundError(
                f"dataset folder not found: {folder} (folders in {root}: {available})"
            )
        return folder

    @property
    def n_splits(self) -> int:
        """Number of splits the dataset provides."""
        return count_uci_splits(self.folder)

    @property
    def _statistics(self) -> _Statistics:
        self._datasets()
        assert self._stats is not None
        return self._stats

    @property
    def in_features(self) -> int:
        """Number of input columns."""
        return self._statistics.in_features

    @property
    def target_loc(self) -> float:
        """Mean of the training targets (0 when not standardising)."""
        return self._statistics.target_loc

    @property
    def target_scale(self) -> float:
        """Standard deviation of the training targets (1 when not standardising)."""
        return self._statistics.target_scale

    @property
    def x_loc(self) -> torch.Tensor:
        """Per-column means of the training inputs, float32 ``[D]``."""
        return self._statistics.x_loc.clone()

    @property
    def x_scale(self) -> torch.Tensor:
        """Per-column standard deviations of the training inputs (1 for constant columns)."""
        return self._statistics.x_scale.clone()

    def _read_split(self, folder: Path, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        n_splits = count_uci_splits(folder)
        if self.split >= n_splits:
            raise ValueError(
                f"split {self.split} is out of range: {self.dataset} has {n_splits} splits "
                f"(0..{n_splits - 1})"
            )
        train = read_indices(folder / f"index_train_{self.split}.txt", size=num_rows, what="rows")
        test = read_indices(folder / f"index_test_{self.split}.txt", size=num_rows, what="rows")
        overlap = np.intersect1d(train, test)
        if overlap.size:
            raise ValueError(
                f"split {self.split} of {self.dataset}: {overlap.size} rows are in both the "
                f"train and test indices, e.g. {overlap[:5].tolist()}"
            )
        return train, test

    def _build(self) -> dict[str, TensorDataset | None]:
        folder = self.folder
        data_path = folder / "data.txt"
        for name in ("data.txt", "index_features.txt", "index_target.txt"):
            if not (folder / name).is_file():
                raise FileNotFoundError(f"missing file of the UCI layout: {folder / name}")
        table = read_table(data_path)
        num_rows, num_cols = table.shape
        features = read_indices(folder / "index_features.txt", size=num_cols, what="columns")
        target = read_indices(folder / "index_target.txt", size=num_cols, what="columns")
        if target.size != 1:
            raise ValueError(f"{folder / 'index_target.txt'} must hold one column index")
        if target[0] in features:
            raise ValueError(f"target column {target[0]} is also listed as a feature")
        train, test = self._read_split(folder, num_rows)

        columns = np.concatenate([features, target])
        used = np.concatenate([train, test])
        bad_rows = used[~np.isfinite(table[np.ix_(used, columns)]).all(axis=1)]
        if bad_rows.size:
            raise ValueError(
                f"{data_path}: {bad_rows.size} rows of split {self.split} hold NaN or infinite "
                f"values, e.g. rows {np.sort(bad_rows)[:5].tolist()} (0-based)"
            )

        train, val = self._carve_validation(train)
        x_all, y_all = table[:, features], table[:, target[0]]
        if self.standardize:
            x_loc, x_scale = fit_standardizer(x_all[train])
            y_loc, y_scale = (float(v[0]) for v in fit_standardizer(y_all[train, None]))
        else:
            x_loc, x_scale = np.zeros(features.size), np.ones(features.size)
            y_loc, y_scale = 0.0, 1.0
        self._stats = _Statistics(
            in_features=int(features.size),
            target_loc=y_loc,
            target_scale=y_scale,
            x_loc=torch.as_tensor(x_loc, dtype=torch.float32),
            x_scale=torch.as_tensor(x_scale, dtype=torch.float32),
        )

        def subset(rows: np.ndarray) -> TensorDataset | None:
            if rows.size == 0:
                return None
            x = torch.as_tensor((x_all[rows] - x_loc) / x_scale, dtype=torch.float32)
            y = torch.as_tensor(y_all[rows], dtype=torch.float32)
            return TensorDataset(x, y)

        test_set = subset(test)
        return {"train": subset(train), "val": subset(val), "test": test_set, "predict": test_set}

    def _carve_validation(self, train: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        if self.val_fraction == 0.0:
            return train, train[:0]
        # At least one validation row whenever validation was asked for.
        num_val = max(1, round(self.val_fraction * train.size))
        if num_val >= train.size:
            raise ValueError(
                f"val_fraction={self.val_fraction} leaves no training rows out of {train.size}"
            )
        order = np.random.default_rng(self.seed).permutation(train.size)
        return np.sort(train[order[num_val:]]), np.sort(train[order[:num_val]])
