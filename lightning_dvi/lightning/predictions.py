"""Predictions as tables: ids, the predictive, the original class labels; one file under DDP.

:func:`prediction_columns` turns ``predict_step`` outputs into named columns, in this order:

* the data module's id columns (``CSVDataModule(id_columns=[...])``), as read;
* regression (:class:`~lightning_dvi.DVIRegressor`): ``mean``, ``std``, ``lower_95``,
  ``upper_95`` (the central 95 % interval of the Gaussian predictive), ``aleatoric_std``,
  ``epistemic_std``, all float64 in the original units of y;
* classification (:class:`~lightning_dvi.DVIClassifier`): ``prob_<label>`` per class, named by
  the class labels as written in the data (``prob_0``, ... without a label mapping),
  ``predicted_class`` (the label itself) and ``entropy`` (nats).

:class:`PredictionWriter` is the callback that ``lightning-dvi predict`` adds: every process
sends its share and their dataset indices to every other, and rank 0 writes one
``predictions.pt``, ``predictions.csv`` and ``predictions.parquet`` with the rows in dataset
order (Lightning hands ranks interleaved, unpadded shares).
"""

from __future__ import annotations

import csv
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import torch.distributed as dist
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

__all__ = ["PredictionWriter", "Predictions", "prediction_columns", "write_predictions"]

Predictions = dict[str, Tensor] | Tensor
_Z95 = 1.959963984540054  # the 97.5 % standard normal quantile


def prediction_columns(
    predictions: Predictions,
    ids: Mapping[str, Sequence[Any] | pa.Array] | None = None,
    labels: Sequence[Any] | None = None,
) -> dict[str, pa.Array]:
    """Named columns, one row per example (see the module docstring for the columns).

    Args:
        predictions: the regressor's dict of ``[N]`` tensors, or the classifier's ``[N, K]``
            probabilities.
        ids: id columns, each with ``N`` values.
        labels: the ``K`` class labels (default ``0..K-1``).

    Raises:
        ValueError: for ids of another length, ``labels`` of another length than ``K``, or an
            id column named like a prediction column.
    """
    columns: dict[str, pa.Array] = {}
    if isinstance(predictions, Mapping):
        mean = predictions["mean"].double()
        std = predictions["var"].double().clamp_min(0).sqrt()
        values = {"mean": mean, "std": std, "lower_95": mean - _Z95 * std}
        values["upper_95"] = mean + _Z95 * std
        for part in ("aleatoric", "epistemic"):
            if f"{part}_var" in predictions:
                values[f"{part}_std"] = predictions[f"{part}_var"].double().clamp_min(0).sqrt()
        columns = {name: pa.array(v.cpu().numpy()) for name, v in values.items()}
    else:
        probs = predictions.double().cpu()
        num_classes = probs.shape[1]
        labels = list(range(num_classes)) if labels is None else list(labels)
        if len(labels) != num_classes:
            raise ValueError(f"{len(labels)} class labels for {num_classes} predicted classes")
        columns = {f"prob_{label}": pa.array(probs[:, k].numpy()) for k, label in enumerate(labels)}
        predicted = probs.argmax(-1).tolist()
        columns["predicted_class"] = pa.array([labels[k] for k in predicted])
        entropy = -(probs * probs.clamp_min(1e-300).log()).sum(-1)
        columns["entropy"] = pa.array(entropy.numpy())
    num_rows = len(next(iter(columns.values())))
    id_columns: dict[str, pa.Array] = {}
    for name, column in (ids or {}).items():
        array = column if isinstance(column, (pa.Array, pa.ChunkedArray)) else pa.array(column)
        if len(array) != num_rows:
            raise ValueError(
                f"id column {name!r} has {len(array)} values for {num_rows} predictions"
            )
        if name in columns:
            raise ValueError(f"id column {name!r} has the name of a prediction column; rename it")
        id_columns[name] = array
    return id_columns | columns


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else str(value)
    return str(value)


def write_predictions(
    predictions: Predictions,
    path: str | Path,
    ids: Mapping[str, Sequence[Any] | pa.Array] | None = None,
    labels: Sequence[Any] | None = None,
) -> Path:
    """Write :func:`prediction_columns` to ``path``: CSV (``.csv``) or Parquet (``.parquet``).

    CSV floats are written with Python's shortest round-trip ``repr``, so they read back
    exactly; ids and labels are written as they were read.
    """
    path = Path(path)
    columns = prediction_columns(predictions, ids, labels)
    if path.suffix.lower() in (".parquet", ".pq"):
        pq.write_table(pa.table(columns), path)
        return path
    names = list(columns)
    values = [columns[name].to_pylist() for name in names]
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(names)
        writer.writerows([_text(v) for v in row] for row in zip(*values, strict=True))
    return path


def _concatenate(outputs: Sequence[Predictions]) -> Predictions:
    if isinstance(outputs[0], Mapping):
        return {k: torch.cat([o[k] for o in outputs]) for k in outputs[0]}  # type: ignore[index]  # all dicts
    return torch.cat(list(outputs))  # type: ignore[arg-type]  # all tensors


def _num_rows(predictions: Predictions) -> int:
    return len(predictions["mean"] if isinstance(predictions, Mapping) else predictions)


def _take(predictions: Predictions, index: Tensor) -> Predictions:
    if isinstance(predictions, Mapping):
        return {k: v[index] for k, v in predictions.items()}
    return predictions[index]


class PredictionWriter(BasePredictionWriter):
    """Write ``trainer.predict``'s outputs as ``predictions.pt``, ``.csv`` and ``.parquet``.

    Under DDP each process gathers every process's share with its dataset indices, and rank 0
    writes one set of files with the rows in dataset order. The data module may provide
    ``predict_ids`` (id columns of the prediction rows) and, for classification, ``labels``
    (the class labels); :class:`~lightning_dvi.data.CSVDataModule` does.

    Args:
        dirpath: where to write; default ``trainer.log_dir`` (else its ``default_root_dir``).
        formats: which files: any of ``"pt"`` (``torch.load(path, weights_only=True)`` reads
            it), ``"csv"``, ``"parquet"``.

    Attributes:
        paths: the files written, by format (rank 0 only).
    """

    def __init__(
        self, dirpath: str | None = None, formats: Sequence[str] = ("pt", "csv", "parquet")
    ) -> None:
        super().__init__(write_interval="epoch")
        unknown = set(formats) - {"pt", "csv", "parquet"}
        if unknown or not formats:
            raise ValueError(f"formats must be some of 'pt', 'csv', 'parquet', got {formats}")
        self.dirpath = dirpath
        self.formats = tuple(formats)
        self.paths: dict[str, Path] = {}

    def write_on_epoch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        """Gather the shares (DDP), put the rows in dataset order, and write on rank 0."""
        # every rank reads log_dir: it is broadcast from rank 0
        folder = Path(self.dirpath or trainer.log_dir or trainer.default_root_dir)
        if len(batch_indices) > 1:
            raise ValueError(
                f"PredictionWriter writes one predict dataloader, got {len(batch_indices)}"
            )
        local = _concatenate(predictions) if predictions else None
        indices = [k for batch in (batch_indices[0] if batch_indices else []) for k in batch]
        shares: list[Any] = [(indices, local)]
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            shares = [None] * trainer.world_size
            dist.all_gather_object(shares, (indices, local))
        if not trainer.is_global_zero:
            return
        shares = [(part, p) for part, p in shares if p is not None]
        if not shares:
            return
        merged = _concatenate([p for _, p in shares])
        index = torch.tensor([k for part, _ in shares for k in part], dtype=torch.long)
        if index.numel() == _num_rows(merged):
            # dataset order; rows that a padding sampler repeated are written once
            order = torch.argsort(index, stable=True)
            first = torch.ones_like(order, dtype=torch.bool)
            first[1:] = index[order][1:] != index[order][:-1]
            merged = _take(merged, order[first])
        self._write(trainer, folder, merged)

    def _write(self, trainer: Trainer, folder: Path, predictions: Predictions) -> None:
        datamodule = getattr(trainer, "datamodule", None)
        ids = getattr(datamodule, "predict_ids", None) or {}
        num_rows = _num_rows(predictions)
        if any(len(column) != num_rows for column in ids.values()):
            rank_zero_warn(
                f"PredictionWriter: the data module's predict_ids do not have {num_rows} rows "
                "(were other dataloaders passed to predict?); writing the predictions without ids"
            )
            ids = {}
        # a regression data module raises AttributeError for labels: getattr gives None
        labels = None if isinstance(predictions, Mapping) else getattr(datamodule, "labels", None)
        folder.mkdir(parents=True, exist_ok=True)
        for kind in self.formats:
            path = folder / f"predictions.{kind}"
            if kind == "pt":
                torch.save(predictions, path)
            else:
                write_predictions(predictions, path, ids, labels)
            self.paths[kind] = path
