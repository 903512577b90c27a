"""LightningDataModule for the user's own tabular files: CSV, NumPy (``.npy``/``.npz``), Parquet.

A table has named columns; one (or more) of them is the target, the others (or those listed) are
the inputs. The data come either from one file split by fractions with a seed, or from separate
training / validation / test files (a split without its own file is carved from ``path``).
Inputs, and regression targets, are standardised with the statistics of the training rows.

Supported files, chosen by suffix:

* ``.csv``, ``.tsv``, ``.txt``: a header row of column names, then one row per example
  (``delimiter`` defaults to ``,``, and to a tab for ``.tsv``);
* ``.npy``: a 2-D numeric array; its columns are named ``"0"``, ``"1"``, ...;
* ``.npz``: either equal-length 1-D arrays, each a column named by its key
  (``np.savez(path, age=..., y=...)``), or a single 2-D array with columns ``"0"``, ``"1"``, ...;
* ``.parquet``/``.pq``: read with pandas (needs ``pandas`` and ``pyarrow``:
  ``pip install lightning_dvi[parquet]``).

Every value of a used column must be a finite number; a bad file fails with a ``ValueError``
naming the file, the row (the 1-based line of a text file, the 0-based row of an array) and the
column.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, TypedDict

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ._base import InMemoryDataModule, fit_standardizer

__all__ = ["CSVDataModule", "read_tabular"]

_TEXT = (".csv", ".tsv", ".txt")
_PARQUET = (".parquet", ".pq")
SUPPORTED_SUFFIXES = (*_TEXT, ".npy", ".npz", *_PARQUET)


@dataclass(frozen=True)
class _Columns:
    """Named float64 columns read from one file, with a way to name a row in messages."""

    path: Path
    names: list[str]
    values: dict[str, np.ndarray]
    row_name: Callable[[int], str]
    num_rows: int


def _fail(path: Path, row: str, column: str, problem: str) -> ValueError:
    return ValueError(f"{path}, {row}, column {column!r}: {problem}")


def _check_columns(path: Path, available: Sequence[str], wanted: Sequence[str]) -> None:
    missing = [c for c in wanted if c not in available]
    if missing:
        raise ValueError(
            f"{path}: no column {missing[0]!r} (columns in the file: {', '.join(available)})"
        )


def _read_text(path: Path, wanted: Sequence[str] | None, delimiter: str | None) -> _Columns:
    if delimiter is None:
        delimiter = "\t" if path.suffix.lower() == ".tsv" else ","
    with path.open(newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        header: list[str] | None = None
        for cells in reader:
            if cells and any(c.strip() for c in cells):
                header = [c.strip() for c in cells]
                break
        if header is None:
            raise ValueError(f"{path} is empty: expected a header row of column names")
        header_line = reader.line_num
        blank = [i + 1 for i, name in enumerate(header) if not name]
        if blank:
            raise ValueError(f"{path}, line {header_line}: header cell {blank[0]} is empty")
        seen: set[str] = set()
        for name in header:
            if name in seen:
                raise ValueError(f"{path}, line {header_line}: column {name!r} appears twice")
            seen.add(name)
        names = list(header) if wanted is None else list(wanted)
        _check_columns(path, header, names)
        positions = [header.index(name) for name in names]
        rows: list[list[float]] = []
        lines: list[int] = []
        for cells in reader:
            if not cells or not any(c.strip() for c in cells):
                continue  # blank lines (e.g. a trailing newline)
            line = reader.line_num
            if len(cells) != len(header):
                raise ValueError(
                    f"{path}, line {line}: {len(cells)} cells, but the header has "
                    f"{len(header)} columns"
                )
            row = []
            for name, position in zip(names, positions, strict=True):
                text = cells[position].strip()
                if not text:
                    raise _fail(path, f"line {line}", name, "empty cell")
                try:
                    value = float(text)
                except ValueError:
                    raise _fail(
                        path,
                        f"line {line}",
                        name,
                        f"non-numeric value {text!r}",
                    ) from None
                if not math.isfinite(value):
                    raise _fail(path, f"line {line}", name, f"{text} (not a finite number)")
                row.append(value)
            rows.append(row)
            lines.append(line)
    if not rows:
        raise ValueError(f"{path} has a header but no data rows")
    table = np.asarray(rows, dtype=np.float64).reshape(len(rows), len(names))
    return _Columns(
        path=path,
        names=names,
        values={name: table[:, j] for j, name in enumerate(names)},
        row_name=lambda i: f"line {lines[i]}",
        num_rows=len(rows),
    )


def _from_arrays(
    path: Path, arrays: dict[str, np.ndarray], wanted: Sequence[str] | None, check: bool = True
) -> _Columns:
    names = list(arrays)
    lengths = {name: len(a) for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"{path}: columns of different lengths {lengths}")
    num_rows = next(iter(lengths.values()))
    if num_rows == 0:
        raise ValueError(f"{path} holds no rows")
    chosen = names if wanted is None else list(wanted)
    _check_columns(path, names, chosen)
    if not check:
        return _Columns(path, chosen, {}, lambda i: f"row {i}", num_rows)
    values = {}
    for name in chosen:
        column = arrays[name]
        if column.dtype.kind not in "biuf":
            # Name the first entry that is not a number.
            for i, item in enumerate(column.tolist()):
                try:
                    float(item)
                except (TypeError, ValueError):
                    raise _fail(path, f"row {i}", name, f"non-numeric value {item!r}") from None
        column = np.asarray(column, dtype=np.float64)
        bad = np.flatnonzero(~np.isfinite(column))
        if bad.size:
            i = int(bad[0])
            raise _fail(path, f"row {i}", name, f"{column[i]} (not a finite number)")
        values[name] = column
    return _Columns(path, chosen, values, lambda i: f"row {i}", num_rows)


def _read_numpy(path: Path, wanted: Sequence[str] | None, check: bool = True) -> _Columns:
    if path.suffix.lower() == ".npy":
        array = np.load(path, allow_pickle=False)
        if array.ndim != 2:
            raise ValueError(
                f"{path}: expected a 2-D array [rows, columns], got shape {array.shape}"
            )
        return _from_arrays(
            path, {str(j): array[:, j] for j in range(array.shape[1])}, wanted, check
        )
    with np.load(path, allow_pickle=False) as archive:
        arrays = {key: archive[key] for key in archive.files}
    if not arrays:
        raise ValueError(f"{path} is empty: no arrays")
    if len(arrays) == 1 and next(iter(arrays.values())).ndim == 2:
        array = next(iter(arrays.values()))
        return _from_arrays(
            path, {str(j): array[:, j] for j in range(array.shape[1])}, wanted, check
        )
    shapes = {key: a.shape for key, a in arrays.items() if a.ndim != 1}
    if shapes:
        raise ValueError(
            f"{path}: expected one 2-D array or 1-D arrays (one per column), got shapes {shapes}"
        )
    return _from_arrays(path, arrays, wanted, check)


def _read_parquet(path: Path, wanted: Sequence[str] | None, check: bool = True) -> _Columns:
    try:
        import pandas as pd
    except ImportError:
        raise ImportError(
            f"reading {path} needs pandas and pyarrow: pip install 'lightning_dvi[parquet]'"
        ) from None
    try:
        frame = pd.read_parquet(path)
    except ImportError as err:
        raise ImportError(
            f"reading {path} needs pyarrow: pip install 'lightning_dvi[parquet]' ({err})"
        ) from None
    arrays = {str(name): frame[name].to_numpy() for name in frame.columns}
    return _from_arrays(path, arrays, wanted, check)


def read_tabular(
    path: str | Path, columns: Sequence[str] | None = None, delimiter: str | None = None
) -> tuple[list[str], np.ndarray, Callable[[int], str]]:
    """Read named numeric columns of a tabular file as float64 ``[rows, len(columns)]``.

    Args:
        path: a ``.csv``/``.tsv``/``.txt``, ``.npy``, ``.npz`` or ``.parquet`` file.
        columns: the columns to read, in order; ``None`` reads all.
        delimiter: for text files (default ``,``; a tab for ``.tsv``).

    Returns:
        The column names, the table, and a function naming row ``i`` in messages
        (``"line 7"`` for text files, ``"row 5"`` for arrays).

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, row and column: a missing column, an empty or non-finite
            cell, a non-numeric value, a ragged row, an empty file or an unsupported suffix.
        ImportError: for Parquet without pandas/pyarrow.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in _TEXT:
        table = _read_text(path, columns, delimiter)
    elif suffix in (".npy", ".npz"):
        table = _read_numpy(path, columns)
    elif suffix in _PARQUET:
        table = _read_parquet(path, columns)
    else:
        raise ValueError(
            f"{path}: unsupported file type {suffix or '(no suffix)'!r}; expected one of "
            f"{', '.join(SUPPORTED_SUFFIXES)}"
        )
    data = np.stack([table.values[name] for name in table.names], axis=1)
    return table.names, data, table.row_name


def _column_names(path: Path, delimiter: str | None) -> list[str]:
    """The column names of a file, without parsing its values."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix in _TEXT:
        if delimiter is None:
            delimiter = "\t" if suffix == ".tsv" else ","
        with path.open(newline="", encoding="utf-8-sig") as handle:
            for cells in csv.reader(handle, delimiter=delimiter):
                if cells and any(c.strip() for c in cells):
                    return [c.strip() for c in cells]
        raise ValueError(f"{path} is empty: expected a header row of column names")
    # Arrays and Parquet: read the (binary) file; values are checked later, per used column.
    if suffix in (".npy", ".npz"):
        return _read_numpy(path, None, check=False).names
    if suffix in _PARQUET:
        return _read_parquet(path, None, check=False).names
    return read_tabular(path, None, delimiter)[0]  # raises for an unsupported suffix


class _Stats(TypedDict, total=False):
    """What the training split fixes: standardiser and targets' moments, or ``K``."""

    x_loc: np.ndarray
    x_scale: np.ndarray
    target_loc: float
    target_scale: float
    num_classes: int


@dataclass(frozen=True)
class _Part:
    """The rows of one file: inputs, targets, and how to name row ``i``."""

    path: Path
    x: np.ndarray
    y: np.ndarray | None
    row_name: Callable[[int], str]


class CSVDataModule(InMemoryDataModule):
    r"""The user's own tabular data: regression or classification from CSV, NumPy or Parquet files.

    Columns are chosen by name: ``target`` (one column; for regression its values are the
    targets, for classification integer class labels ``0..K-1``) and ``features`` (default: every
    other column). Splits come from separate files (``val_path``, ``test_path``) or, for a split
    without its own file, from ``path`` by a seeded random permutation: a ``test_fraction`` and a
    ``val_fraction`` of the rows of ``path`` (``round(fraction * rows)``, at least one row when
    the fraction is positive).

    Inputs are standardised, ``x' = (x - x_loc) / x_scale``, with the mean and standard
    deviation (``ddof=0``) of the training rows. Regression targets stay in their original units;
    their training mean and standard deviation are exposed as ``target_loc``/``target_scale``,
    with which :class:`~lightning_dvi.DVIRegressor` standardises them
    (``y' = (y - target_loc) / target_scale``), so predictions and test metrics come back in the
    original units. Constant training columns get scale 1. Batches are
    ``(x [B, D] float32, y [B])``: float32 targets for regression, int64 labels for
    classification. ``predict_dataloader`` yields the rows of ``predict_path`` (its target column
    may be absent) or else the test split.

    The attributes the CLI links to the model (``in_features``, ``num_train`` -> ``num_data``,
    ``target_loc``/``target_scale`` for regression, ``num_classes`` for classification) are
    readable right after construction: reading one loads the files.

    Args:
        path: the data file, or the training file when ``val_path``/``test_path`` are given.
        target: the target column's name (an integer names a column of a header-less ``.npy``
            array: ``0`` is ``"0"``). A one-element list is accepted.
        features: input column names, in order; ``None`` takes every column except the target.
        task: ``"regression"`` or ``"classification"``.
        val_path: a separate validation file with the same columns; else ``val_fraction``.
        test_path: a separate test file with the same columns; else ``test_fraction``.
        predict_path: inputs to predict on (the target column is optional there).
        val_fraction: fraction of the rows of ``path`` held out for validation when there is
            no ``val_path``; 0 disables validation.
        test_fraction: fraction of the rows of ``path`` held out for testing when there is no
            ``test_path``; 0 disables testing.
        num_classes: classification only: the number of classes ``K`` (default: the largest
            label in the files plus one).
        standardize: standardise inputs (and regression targets) with training statistics;
            ``False`` leaves them as they are (loc 0, scale 1).
        delimiter: the separator of text files (default ``,``; a tab for ``.tsv``).
        batch_size: mini-batch size for every loader.
        seed: seeds the split and the training-set shuffling.

    Raises:
        FileNotFoundError: naming a missing file.
        ValueError: for bad arguments, and for bad files naming the file, row and column: a
            missing column, an empty, NaN or infinite cell, a non-numeric value, a ragged row,
            an empty file, a class label that is not an integer in ``[0, num_classes)``.

    Examples:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> rows = "\n".join(f"{i},{i % 3},{2.0 * i}" for i in range(20))
        >>> _ = (folder / "data.csv").write_text("a,b,y\n" + rows + "\n")
        >>> dm = CSVDataModule(str(folder / "data.csv"), target="y", test_fraction=0.2)
        >>> dm.in_features, dm.num_train, dm.num_val, dm.num_test
        (2, 14, 2, 4)
        >>> dm.feature_names
        ['a', 'b']
    """

    def __init__(
        self,
        path: str,
        target: str | int | list[str | int],
        features: list[str | int] | None = None,
        task: Literal["regression", "classification"] = "regression",
        val_path: str | None = None,
        test_path: str | None = None,
        predict_path: str | None = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.0,
        num_classes: int | None = None,
        standardize: bool = True,
        delimiter: str | None = None,
        batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed)
        if task not in ("regression", "classification"):
            raise ValueError(f"task must be 'regression' or 'classification', got {task!r}")
        targets = [str(t) for t in (target if isinstance(target, list) else [target])]
        if len(targets) != 1:
            raise ValueError(
                f"target must name one column, got {targets}: DVIRegressor and DVIClassifier "
                "model one target (train one model per target column)"
            )
        feature_names = None if features is None else [str(f) for f in features]
        if feature_names is not None:
            if not feature_names:
                raise ValueError("features must name at least one column (or be None for all)")
            if targets[0] in feature_names:
                raise ValueError(f"target column {targets[0]!r} is also listed in features")
            if len(set(feature_names)) != len(feature_names):
                raise ValueError(f"features lists a column twice: {feature_names}")
        for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not (math.isfinite(fraction) and 0.0 <= fraction < 1.0):
                raise ValueError(f"{name} must lie in [0, 1), got {fraction}")
        carved = (val_fraction if val_path is None else 0.0) + (
            test_fraction if test_path is None else 0.0
        )
        if carved >= 1.0:
            raise ValueError(
                "val_fraction + test_fraction must stay below 1 so that a training set is left, "
                f"got {val_fraction} + {test_fraction}"
            )
        if num_classes is not None and (task != "classification" or num_classes < 2):
            raise ValueError(
                f"num_classes is for task='classification' and must be >= 2, got {num_classes} "
                f"with task={task!r}"
            )
        if delimiter is not None and len(delimiter) != 1:
            raise ValueError(f"delimiter must be one character, got {delimiter!r}")
        self.path = path
        self.target = targets[0]
        self.features = feature_names
        self.task = task
        self.val_path = val_path
        self.test_path = test_path
        self.predict_path = predict_path
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.standardize = standardize
        self.delimiter = delimiter
        self._num_classes_arg = num_classes
        self._feature_names: list[str] | None = None
        self._stats: _Stats = {}

    # ------------------------------------------------------------------ linked attributes
    @property
    def feature_names(self) -> list[str]:
        """The input columns, in the order of ``x``'s last dimension."""
        self._datasets()
        assert self._feature_names is not None
        return list(self._feature_names)

    @property
    def in_features(self) -> int:
        """Number of input columns."""
        return len(self.feature_names)

    @property
    def x_loc(self) -> torch.Tensor:
        """Per-column means of the training inputs, float32 ``[D]`` (0 without standardising)."""
        self._datasets()
        return torch.as_tensor(self._stats["x_loc"], dtype=torch.float32)

    @property
    def x_scale(self) -> torch.Tensor:
        """Per-column standard deviations of the training inputs (1 for constant columns)."""
        self._datasets()
        return torch.as_tensor(self._stats["x_scale"], dtype=torch.float32)

    @property
    def target_loc(self) -> float:
        """Mean of the training targets (regression only; 0 without standardising)."""
        if self.task != "regression":
            raise AttributeError("target_loc: classification targets are not standardised")
        self._datasets()
        return float(self._stats["target_loc"])

    @property
    def target_scale(self) -> float:
        """Standard deviation of the training targets (regression only; 1 without standardising)."""
        if self.task != "regression":
            raise AttributeError("target_scale: classification targets are not standardised")
        self._datasets()
        return float(self._stats["target_scale"])

    @property
    def num_classes(self) -> int:
        """Number of classes ``K`` (classification only)."""
        if self.task != "classification":
            raise AttributeError("num_classes: only for task='classification'")
        self._datasets()
        return int(self._stats["num_classes"])

    # ------------------------------------------------------------------ loading
    def _resolve_features(self, path: Path) -> list[str]:
        if self.features is not None:
            return list(self.features)
        names = _column_names(path, self.delimiter)
        if self.target not in names:
            raise ValueError(
                f"{path}: no column {self.target!r} (columns in the file: {', '.join(names)})"
            )
        features = [n for n in names if n != self.target]
        if not features:
            raise ValueError(f"{path}: no input columns besides the target {self.target!r}")
        return features

    def _read(self, path_text: str, features: list[str], *, need_target: bool) -> _Part:
        path = Path(path_text).expanduser()
        wanted = [*features, self.target]
        if not need_target:
            available = _column_names(path, self.delimiter)
            if self.target not in available:
                wanted = list(features)
        try:
            names, table, row_name = read_tabular(path, wanted, self.delimiter)
        except ValueError as err:
            if self.features is None and "non-numeric value" in str(err):
                raise ValueError(
                    f"{err} (list the input columns in `features` to leave a non-numeric "
                    "column out)"
                ) from None
            raise
        x = table[:, : len(features)]
        y = table[:, len(features)] if len(names) > len(features) else None
        if y is not None and self.task == "classification":
            bad = np.flatnonzero((y != np.round(y)) | (y < 0))
            if bad.size:
                i = int(bad[0])
                raise _fail(
                    path,
                    row_name(i),
                    self.target,
                    f"class label {y[i]:g} is not an integer >= 0 (classes are 0..K-1)",
                )
        return _Part(path, x, y, row_name)

    def _build(self) -> dict[str, TensorDataset | None]:
        main_path = Path(self.path).expanduser()
        features = self._resolve_features(main_path)
        self._feature_names = features
        main = self._read(self.path, features, need_target=True)
        num_rows: int = main.x.shape[0]
        order = np.random.default_rng(self.seed).permutation(num_rows)

        def count(fraction: float, separate: str | None) -> int:
            if separate is not None or fraction == 0.0:
                return 0
            return max(1, round(fraction * num_rows))

        num_test = count(self.test_fraction, self.test_path)
        num_val = count(self.val_fraction, self.val_path)
        if num_test + num_val >= num_rows:
            raise ValueError(
                f"{main_path}: {num_rows} rows leave no training rows after holding out "
                f"{num_val} for validation and {num_test} for testing"
            )
        test_rows = np.sort(order[:num_test])
        val_rows = np.sort(order[num_test : num_test + num_val])
        train_rows = np.sort(order[num_test + num_val :])

        assert main.y is not None
        files = [main]
        parts: dict[str, tuple[np.ndarray, np.ndarray | None]] = {
            "train": (main.x[train_rows], main.y[train_rows]),
        }
        for split, separate, rows in (
            ("val", self.val_path, val_rows),
            ("test", self.test_path, test_rows),
        ):
            if separate is not None:
                part = self._read(separate, features, need_target=True)
                files.append(part)
                parts[split] = (part.x, part.y)
            else:
                parts[split] = (main.x[rows], main.y[rows])
        if self.predict_path is not None:
            part = self._read(self.predict_path, features, need_target=False)
            files.append(part)
            parts["predict"] = (part.x, part.y)

        x_train, y_train = main.x[train_rows], main.y[train_rows]
        if self.standardize:
            x_loc, x_scale = fit_standardizer(x_train)
        else:
            x_loc, x_scale = np.zeros(len(features)), np.ones(len(features))
        self._stats = {"x_loc": x_loc, "x_scale": x_scale}
        y_loc, y_scale = 0.0, 1.0
        if self.task == "regression":
            if self.standardize:
                y_loc, y_scale = (float(v[0]) for v in fit_standardizer(y_train[:, None]))
            self._stats.update({"target_loc": y_loc, "target_scale": y_scale})
        else:
            self._stats["num_classes"] = self._check_classes(files)

        def dataset(x: np.ndarray, y: np.ndarray | None) -> TensorDataset | None:
            if x.shape[0] == 0:
                return None
            inputs = torch.as_tensor((x - x_loc) / x_scale, dtype=torch.float32)
            if y is None:
                return TensorDataset(inputs)
            if self.task == "classification":
                return TensorDataset(inputs, torch.as_tensor(y, dtype=torch.long))
            # raw targets: the regressor standardises them with target_loc/target_scale
            return TensorDataset(inputs, torch.as_tensor(y, dtype=torch.float32))

        splits = {name: dataset(x, y) for name, (x, y) in parts.items()}
        splits.setdefault("predict", splits["test"])
        return splits

    def _check_classes(self, files: list[_Part]) -> int:
        """``K``: ``num_classes`` or the largest label plus one; every label must be below it."""
        labelled = [(part, part.y) for part in files if part.y is not None and part.y.size]
        largest = int(max(float(y.max()) for _, y in labelled))
        num_classes = self._num_classes_arg if self._num_classes_arg is not None else largest + 1
        for part, y in labelled:
            bad = np.flatnonzero(y >= num_classes)
            if bad.size:
                i = int(bad[0])
                raise _fail(
                    part.path,
                    part.row_name(i),
                    self.target,
                    f"class label {y[i]:g} is out of range for num_classes={num_classes}",
                )
        if num_classes < 2:
            raise ValueError(
                f"{files[0].path}: column {self.target!r} holds a single class (0); "
                "classification needs at least 2"
            )
        return num_classes
