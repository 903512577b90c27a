"""LightningDataModule for the user's own tabular files: CSV/TSV, Parquet, NumPy (``.npy``/``.npz``).

A table has named columns: one is the target, some may be ids (carried into the predictions)
or dropped, the others (or those listed) are the inputs. The data come either from one file
split by fractions with a seed, or from separate training / validation / test files (a split
without its own file is carved from ``path``).

Supported files, chosen by suffix:

* ``.csv``, ``.tsv``, ``.txt``: a header row of column names, then one row per example
  (``delimiter`` defaults to ``,``, and to a tab for ``.tsv``; ``encoding`` to UTF-8), read by
  ``pyarrow.csv``;
* ``.parquet``/``.pq``: read by ``pyarrow.parquet``;
* ``.npy``: a 2-D numeric array; its columns are named ``"0"``, ``"1"``, ...;
* ``.npz``: either equal-length 1-D arrays, each a column named by its key
  (``np.savez(path, age=..., y=...)``), or a single 2-D array with columns ``"0"``, ``"1"``, ...

Numbers are kept as written: parsed strictly (see :mod:`lightning_dvi.data._read`), held in
float64 until they are standardised, and checked to fit in float32 afterwards. A bad file fails
with a ``ValueError`` naming the file, the row (the 1-based line of a text file, the 0-based row
of an array) and the column.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypedDict

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import TensorDataset

from ._base import InMemoryDataModule, fit_standardizer
from ._labels import Label, LabelColumn, resolve_labels
from ._read import column_names, fail, missing_column, read_columns, read_tabular

__all__ = ["CSVDataModule", "read_tabular"]  # read_tabular: re-exported from ._read

_FLOAT32_MAX = float(np.finfo(np.float32).max)


class _Stats(TypedDict, total=False):
    """What the training split fixes: the standardisers, or the class labels."""

    x_loc: np.ndarray
    x_scale: np.ndarray
    target_loc: float
    target_scale: float
    labels: list[Label]


@dataclass
class _Part:
    """The rows of one file: float64 inputs, targets (regression) or labels, ids."""

    path: Path
    x: np.ndarray
    y: np.ndarray | None
    labels: LabelColumn | None
    ids: dict[str, pa.Array]
    row_name: Callable[[int], str]
    classes: np.ndarray | None = field(default=None)  # set once every file's labels are known


def _as_float32(
    part: _Part,
    rows: np.ndarray,
    standardized: np.ndarray,
    raw: np.ndarray,
    columns: Sequence[str],
    loc: np.ndarray,
    scale: np.ndarray,
) -> np.ndarray:
    """``standardized [n, d]`` as float32; a value float32 cannot hold is an error naming it.

    ``raw [*, d]`` holds the values as read, its row ``rows[i]`` for row ``i``.
    """
    with np.errstate(over="ignore"):
        out = standardized.astype(np.float32)
    overflow = np.isinf(out)
    if not overflow.any():
        return out
    i, j = (int(k) for k in np.argwhere(overflow)[0])
    how = (
        f"(x - {loc[j]:.6g}) / {scale[j]:.6g} = {standardized[i, j]:.6g} after standardising "
        "with the training rows' mean and standard deviation"
        if (loc[j], scale[j]) != (0.0, 1.0)
        else "unstandardised"
    )
    raise fail(
        part.path,
        part.row_name(int(rows[i])),
        columns[j],
        f"{raw[rows[i], j]:.6g} does not fit in float32 ({how}; the largest float32 is "
        f"{_FLOAT32_MAX:.6g}): rescale the column, or drop the row",
    )


class CSVDataModule(InMemoryDataModule):
    r"""The user's own tabular data: regression or classification from CSV, Parquet or NumPy files.

    Columns are chosen by name: ``target`` (one column: the regression targets, or the class
    labels), ``id_columns`` (carried into the predictions, never inputs), ``drop_columns``
    (ignored) and ``features`` (default: every other column). Splits come from separate files
    (``val_path``, ``test_path``) or, for a split without its own file, from ``path`` by a
    seeded random permutation: a ``test_fraction`` and a ``val_fraction`` of the rows of
    ``path`` (``round(fraction * rows)``, at least one row when the fraction is positive).

    Inputs are standardised in float64, ``x' = (x - x_loc) / x_scale``, with the mean and
    standard deviation (``ddof=0``) of the training rows, then cast to float32; a value that
    float32 cannot hold after that is an error naming its file, row and column. Regression
    targets stay in their original units, as float64: their training mean and standard
    deviation are exposed as ``target_loc``/``target_scale``, with which
    :class:`~lightning_dvi.DVIRegressor` standardises them in float64 before the cast
    (``y' = (y - target_loc) / target_scale``), so predictions and test metrics come back in
    the original units, against the file's values. Constant training columns get scale 1.

    Class labels are integers (any, e.g. ``1, 2, 3`` or ``0, 3000000000``) or text; they map to
    classes ``0..K-1`` by sorted value (``labels`` fixes the order instead). The classes are
    the labels of ``path``: a label found only in ``val_path``, ``test_path`` or
    ``predict_path`` is an error naming it and the file, unless ``labels`` (or ``num_classes``)
    declares it, which also allows a declared class with no training rows. The mapping,
    :attr:`labels`, is a hyper-parameter of the data module, so checkpoints carry it, and
    ``lightning-dvi predict`` writes predictions with the original labels.

    Batches are ``(x [B, D] float32, y [B])``: float64 targets for regression, int64 classes
    for classification. ``predict_dataloader`` yields the rows of ``predict_path`` (its target
    column may be absent) or else the test split; :attr:`predict_ids` holds their ids.

    The attributes the CLI links to the model (``in_features``, ``num_train`` -> ``num_data``,
    ``target_loc``/``target_scale`` for regression, ``num_classes`` for classification) are
    readable right after construction: reading one loads the files.

    Args:
        path: the data file, or the training file when ``val_path``/``test_path`` are given.
        target: the target column's name (an integer names a column of a header-less ``.npy``
            array: ``0`` is ``"0"``). A one-element list is accepted.
        features: input column names, in order; ``None`` takes every column except the target,
            the id columns and the dropped columns.
        task: ``"regression"`` or ``"classification"``.
        val_path: a separate validation file with the same columns; else ``val_fraction``.
        test_path: a separate test file with the same columns; else ``test_fraction``.
        predict_path: inputs to predict on (the target column is optional there).
        val_fraction: fraction of the rows of ``path`` held out for validation when there is
            no ``val_path``; 0 disables validation.
        test_fraction: fraction of the rows of ``path`` held out for testing when there is no
            ``test_path``; 0 disables testing.
        num_classes: classification with integer labels ``0..num_classes-1`` (a class may be
            absent from the files); default: the labels found in ``path``.
        standardize: standardise inputs (and regression targets) with training statistics;
            ``False`` leaves them as they are (loc 0, scale 1).
        delimiter: the separator of text files (default ``,``; a tab for ``.tsv``).
        batch_size: mini-batch size for every loader.
        seed: seeds the split and the training-set shuffling.
        id_columns: columns that identify a row (e.g. ``customer_id``): never inputs, read as
            written, required in every file, and written next to each prediction.
        drop_columns: columns to leave out of the default ``features``.
        labels: classification: the class labels in class order (class ``k`` is
            ``labels[k]``); every label in the files must be one of them, and a listed label
            may be absent from the training rows. Default: the sorted distinct labels of
            ``path``, and a label only in another file is an error.
        encoding: the text encoding of text files (default UTF-8, with or without BOM), e.g.
            ``"latin-1"``.

    Raises:
        FileNotFoundError: naming a missing file.
        ValueError: for bad arguments, and for bad files naming the file, row and column: a
            missing column, an empty, non-numeric or non-finite cell, a value that does not fit
            in float32, a ragged row, text not in ``encoding``, an empty file, a class label
            outside ``labels``/``num_classes`` (without them: outside the labels of ``path``)
            or a fractional one.

    Examples:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> rows = "\n".join(f"c{i},{i},{i % 3},{'ab'[i % 2]}" for i in range(20))
        >>> _ = (folder / "data.csv").write_text("id,a,b,y\n" + rows + "\n")
        >>> dm = CSVDataModule(str(folder / "data.csv"), target="y", task="classification",
        ...                    id_columns=["id"], test_fraction=0.2)
        >>> dm.in_features, dm.num_train, dm.num_val, dm.num_test, dm.labels
        (2, 14, 2, 4, ['a', 'b'])
        >>> dm.feature_names, dm.predict_ids["id"].to_pylist()
        (['a', 'b'], ['c2', 'c4', 'c6', 'c19'])
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
        id_columns: list[str | int] | None = None,
        drop_columns: list[str | int] | None = None,
        labels: list[int | str] | None = None,
        encoding: str = "utf-8",
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
        ids = [str(c) for c in id_columns or []]
        drops = [str(c) for c in drop_columns or []]
        feature_names = None if features is None else [str(f) for f in features]
        for name, listed in (
            ("features", feature_names),
            ("id_columns", ids),
            ("drop_columns", drops),
        ):
            if listed is None:
                continue
            if name == "features" and not listed:
                raise ValueError("features must name at least one column (or be None for all)")
            if targets[0] in listed:
                raise ValueError(f"target column {targets[0]!r} is also listed in {name}")
            if len(set(listed)) != len(listed):
                raise ValueError(f"{name} lists a column twice: {listed}")
        both = set(feature_names or []) & set(ids + drops) or set(ids) & set(drops)
        if both:
            raise ValueError(
                f"column {sorted(both)[0]!r} is listed in two of features, id_columns and "
                "drop_columns"
            )
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
        if labels is not None and (task != "classification" or len(labels) < 2):
            raise ValueError(
                f"labels is for task='classification' and must list >= 2 classes, got {labels} "
                f"with task={task!r}"
            )
        if delimiter is not None and len(delimiter) != 1:
            raise ValueError(f"delimiter must be one character, got {delimiter!r}")
        try:
            codecs.lookup(encoding)
        except LookupError:
            raise ValueError(f"encoding: unknown text encoding {encoding!r}") from None
        # Every argument but num_classes, which the classifier also has (Lightning refuses a
        # key that the model's and the data module's hyper-parameters share with two values).
        self.save_hyperparameters(ignore=["num_classes"])
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
        self.encoding = encoding
        self.id_columns = ids
        self.drop_columns = drops
        self._num_classes_arg = num_classes
        self._labels_arg = labels
        self._feature_names: list[str] | None = None
        self._stats: _Stats = {}
        self._predict_ids: dict[str, pa.Array] = {}

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
        """Per-column means of the training inputs, float64 ``[D]`` (0 without standardising)."""
        self._datasets()
        return torch.as_tensor(self._stats["x_loc"], dtype=torch.float64)

    @property
    def x_scale(self) -> torch.Tensor:
        """Per-column standard deviations of the training inputs, float64 (1 for constant columns)."""
        self._datasets()
        return torch.as_tensor(self._stats["x_scale"], dtype=torch.float64)

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
    def labels(self) -> list[Label]:
        """The class labels as written (classification only): class ``k`` is ``labels[k]``."""
        if self.task != "classification":
            raise AttributeError("labels: only for task='classification'")
        self._datasets()
        return list(self._stats["labels"])

    @property
    def num_classes(self) -> int:
        """Number of classes ``K`` (classification only)."""
        return len(self.labels)

    @property
    def predict_ids(self) -> dict[str, pa.Array]:
        """The ``id_columns`` of the prediction rows, in the order of ``predict_dataloader``."""
        self._datasets()
        return dict(self._predict_ids)

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """What a model trained on this data depends on: the input statistics and the labels."""
        if self._splits is None:
            return {}
        state: dict[str, Any] = {
            "x_loc": self._stats["x_loc"].tolist(),
            "x_scale": self._stats["x_scale"].tolist(),
        }
        if self.task == "classification":
            state["labels"] = list(self._stats["labels"])
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Refuse to predict or resume with other input statistics or labels than trained with.

        Lightning calls this with the checkpoint's state whenever it restores one
        (``fit``/``validate``/``test``/``predict`` with ``ckpt_path``).
        """
        self._datasets()
        saved_labels = state_dict.get("labels")
        if saved_labels is not None and list(saved_labels) != self.labels:
            raise ValueError(
                f"the checkpoint's classes are the labels {list(saved_labels)}, but this data "
                f"module's files give {self.labels}: pass labels={list(saved_labels)}"
            )
        trained = {"x_loc": self._stats["x_loc"], "x_scale": self._stats["x_scale"]}
        for key, current in trained.items():
            saved = state_dict.get(key)
            if saved is not None and not np.allclose(saved, current, rtol=1e-9, atol=0.0):
                raise ValueError(
                    f"the checkpoint was trained on inputs standardised with {key}={saved}, but "
                    f"this data module's training rows ({self.path}) give {current.tolist()}: "
                    "keep the training file as `path` and give the new rows as `predict_path`"
                )

    # ------------------------------------------------------------------ loading
    def _resolve_features(self, path: Path) -> list[str]:
        names = column_names(path, self.delimiter, self.encoding)
        for column in (self.target, *self.id_columns, *self.drop_columns):
            if column not in names:
                raise missing_column(path, names, column, self.delimiter)
        if self.features is not None:
            return list(self.features)
        left_out = {self.target, *self.id_columns, *self.drop_columns}
        features = [n for n in names if n not in left_out]
        if not features:
            raise ValueError(f"{path}: no input columns besides {', '.join(sorted(left_out))}")
        return features

    def _read(self, path_text: str, features: list[str], *, need_target: bool) -> _Part:
        path = Path(path_text).expanduser()
        has_target = need_target or self.target in column_names(path, self.delimiter, self.encoding)
        regression = self.task == "regression"
        numbers = [*features, *([self.target] if has_target and regression else [])]
        values = [*([self.target] if has_target and not regression else []), *self.id_columns]
        try:
            table = read_columns(
                path, numbers, values, delimiter=self.delimiter, encoding=self.encoding
            )
        except ValueError as err:
            if "non-numeric value" not in str(err):
                raise
            if f"column {self.target!r}:" in str(err):
                hint = "a target of labels or text needs task='classification'"
            elif self.features is None:
                hint = (
                    "list the input columns in `features`, or name the others in `id_columns` "
                    "or `drop_columns`, to leave a non-numeric column out"
                )
            else:
                raise
            raise ValueError(f"{err} ({hint})") from None
        x = np.stack([table.numbers[name] for name in features], axis=1)
        y = table.numbers[self.target] if has_target and regression else None
        labels = None
        if has_target and not regression:
            labels = LabelColumn.from_array(
                path, self.target, table.values[self.target], table.row_name
            )
        ids = {name: table.values[name] for name in self.id_columns}
        return _Part(path, x, y, labels, ids, table.row_name)

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
        train_rows = np.sort(order[num_test + num_val :])
        splits: dict[str, tuple[_Part, np.ndarray]] = {"train": (main, train_rows)}
        files = [main]
        for split, separate, rows in (
            ("val", self.val_path, np.sort(order[num_test : num_test + num_val])),
            ("test", self.test_path, np.sort(order[:num_test])),
        ):
            if separate is None:
                splits[split] = (main, rows)
                continue
            part = self._read(separate, features, need_target=True)
            files.append(part)
            splits[split] = (part, np.arange(part.x.shape[0]))
        if self.predict_path is not None:
            part = self._read(self.predict_path, features, need_target=False)
            files.append(part)
            splits["predict"] = (part, np.arange(part.x.shape[0]))
        else:
            splits["predict"] = splits["test"]

        x_train = main.x[train_rows]
        if self.standardize:
            x_loc, x_scale = fit_standardizer(x_train)
        else:
            x_loc, x_scale = np.zeros(len(features)), np.ones(len(features))
        self._stats = {"x_loc": x_loc, "x_scale": x_scale}
        y_loc, y_scale = np.zeros(1), np.ones(1)
        if self.task == "regression":
            assert main.y is not None
            if self.standardize:
                y_loc, y_scale = fit_standardizer(main.y[train_rows, None])
            self._stats.update({"target_loc": float(y_loc[0]), "target_scale": float(y_scale[0])})
        else:
            # the training file first: unless declared, its labels are the classes
            labelled = [part for part in files if part.labels is not None]
            labels, classes = resolve_labels(
                [part.labels for part in labelled if part.labels is not None],
                self._labels_arg,
                self._num_classes_arg,
            )
            for part, per_row in zip(labelled, classes, strict=True):
                part.classes = per_row
            self._stats["labels"] = labels
            self.hparams["labels"] = labels  # the mapping travels with the checkpoint

        def dataset(part: _Part, rows: np.ndarray) -> TensorDataset | None:
            if rows.size == 0:
                return None
            x = part.x[rows]
            x -= x_loc
            x /= x_scale
            x32 = _as_float32(part, rows, x, part.x, features, x_loc, x_scale)
            inputs = torch.from_numpy(x32)
            if part.classes is not None:
                return TensorDataset(inputs, torch.as_tensor(part.classes[rows]))
            if part.y is None:
                return TensorDataset(inputs)
            y = part.y[rows]
            _as_float32(part, rows, (y[:, None] - y_loc) / y_scale, part.y[:, None], [self.target],
                        y_loc, y_scale)  # fmt: skip
            # original units, float64: the regressor standardises them before any cast
            return TensorDataset(inputs, torch.from_numpy(y))

        predict_part, predict_rows = splits["predict"]
        self._predict_ids = {
            name: column.take(pa.array(predict_rows)) for name, column in predict_part.ids.items()
        }
        return {name: dataset(part, rows) for name, (part, rows) in splits.items()}
