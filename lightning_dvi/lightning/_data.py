"""What a LightningModule can learn about its data in ``setup()``: shapes, sizes, target statistics.

Values come, in this order, from the trainer's datamodule attributes (``in_features``,
``num_train``, ``num_classes``; a regressor reads the target statistics through
:class:`~lightning_dvi.transforms.TargetStatistics`), from the datamodule's or the loader's
dataset, and from the first batch. Plain dataloaders passed to ``Trainer.fit`` are read through
the trainer's data source for the stage, before Lightning wraps them (so under DDP every process
sees the whole training set and computes the same statistics).

The one private Lightning attribute the package reads is that data source (``loop._data_source``):
no public API hands over the loaders given to ``fit()`` before the loop's ``setup_data()``, and
calling that public method here instead moves a draw of the global RNG (the loader iterator's
base seed) ahead of the network's initialisation, which changes a fit whose network is built from
the data (a classifier reading ``num_classes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

__all__ = ["DataView"]

_LOOPS = {
    "fit": "fit_loop",
    "validate": "validate_loop",
    "test": "test_loop",
    "predict": "predict_loop",
}


def _first_loader(loaders: Any) -> DataLoader | None:
    if isinstance(loaders, DataLoader):
        return loaders
    values: Iterable[Any] = ()
    if isinstance(loaders, Mapping):
        values = loaders.values()
    elif isinstance(loaders, Sequence) and not isinstance(loaders, (str, bytes)):
        values = loaders
    for value in values:
        found = _first_loader(value)
        if found is not None:
            return found
    return None


def _split(batch: Any) -> tuple[Tensor, Tensor | None]:
    if isinstance(batch, Tensor):
        return batch, None
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[0], Tensor):
        y = batch[1] if len(batch) > 1 and isinstance(batch[1], Tensor) else None
        return batch[0], y
    raise ValueError(
        f"batches must be an input tensor x or a pair (x, y) of tensors, got {type(batch).__name__}"
    )


class DataView:
    """The data a stage will run on, as the module's ``setup(stage)`` can see it.

    Args:
        trainer: the trainer running the stage.
        stage: ``"fit"``, ``"validate"``, ``"test"`` or ``"predict"``.
    """

    def __init__(self, trainer: Trainer, stage: str) -> None:
        self.trainer = trainer
        self.stage = stage
        self.datamodule = getattr(trainer, "datamodule", None)
        self._loader: DataLoader | None = None
        self._loader_read = False

    def attribute(self, name: str) -> Any:
        """``trainer.datamodule.<name>``, or ``None`` without a datamodule or attribute."""
        return getattr(self.datamodule, name, None) if self.datamodule is not None else None

    def loader(self) -> DataLoader | None:
        """The stage's (first) dataloader, or ``None`` when there is none."""
        if not self._loader_read:
            self._loader_read = True
            loop = getattr(self.trainer, _LOOPS.get(self.stage, ""), None)
            source = getattr(loop, "_data_source", None)
            if source is not None and source.is_defined():
                self._loader = _first_loader(source.dataloader())
        return self._loader

    def dataset(self) -> Any:
        """The training split (``datamodule.train_dataset``) or the loader's dataset."""
        if self.stage == "fit":
            dataset = self.attribute("train_dataset")
            if dataset is not None:
                return dataset
        loader = self.loader()
        return None if loader is None else loader.dataset

    def first_batch(self) -> tuple[Tensor, Tensor | None] | None:
        """``(x, y)`` of the first example batch (``y`` is ``None`` for input-only batches)."""
        dataset = self.dataset()
        if isinstance(dataset, TensorDataset):
            tensors = dataset.tensors
            return tensors[0][:2], (tensors[1][:2] if len(tensors) > 1 else None)
        loader = self.loader()
        if loader is None:
            return None
        for batch in loader:
            return _split(batch)
        return None

    def num_examples(self) -> int | None:
        """Size of the dataset (``None`` for an iterable dataset without a length)."""
        dataset = self.dataset()
        if dataset is None or isinstance(dataset, IterableDataset):
            return None
        try:
            return len(dataset)
        except TypeError:
            return None

    def targets(self) -> Tensor | None:
        """Every target of the dataset, concatenated (one pass over the loader if needed)."""
        dataset = self.dataset()
        if isinstance(dataset, TensorDataset):
            return dataset.tensors[1] if len(dataset.tensors) > 1 else None
        loader = self.loader()
        if loader is None:
            return None
        parts = []
        for batch in loader:
            y = _split(batch)[1]
            if y is None:
                return None
            parts.append(y.detach().reshape(y.shape[0], -1) if y.dim() > 1 else y.detach())
        return torch.cat(parts) if parts else None
