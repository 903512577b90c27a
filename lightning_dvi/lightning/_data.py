"""What a LightningModule can learn about its data in ``setup()``: shapes, sizes, target statistics.

Values come, in this order, from the trainer's datamodule attributes (``in_features``,
``num_train``, ``num_classes``; a regressor reads the target statistics through
:class:`~lightning_dvi.transforms.TargetStatistics`), from the datamodule's or the loader's
dataset, and from the first batch. Under DDP the loader's dataset is read whole (not the
process's shard), so every process computes the same statistics.

Plain loaders are read through public Lightning API only: the stage's loop is asked to
``setup_data()`` (what Lightning's maintainers advise for reading loaders before the loop starts),
and the loaders are then the trainer's ``train_dataloader`` (``val_dataloaders``, ...). That call
happens only when the datamodule does not already give the facts, and under a forked RNG, so the
network's initialisation draws the numbers it drew before. Lightning does not set the data up a
second time, so one draw it used to make after the initialisation (the loader iterator's base
seed) is no longer made: a fit given plain loaders continues the RNG stream one draw earlier
than when the loop's private data source was read (sampled modes' fixed-seed
results change; the closed-form modes' do not). A loader that saves its own state (a
stateful loader resumed mid-epoch) is set up before the checkpoint's loop state is restored, so
it restarts its epoch; give such loaders through a datamodule with a ``train_dataset``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from lightning.pytorch import Trainer
from torch import Tensor
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

__all__ = ["DataView"]

_LOOPS = {
    "fit": ("fit_loop", "train_dataloader"),
    "validate": ("validate_loop", "val_dataloaders"),
    "test": ("test_loop", "test_dataloaders"),
    "predict": ("predict_loop", "predict_dataloaders"),
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


def _whole(loader: DataLoader | None) -> DataLoader | None:
    if loader is None or not isinstance(loader.sampler, DistributedSampler):
        return loader
    return DataLoader(loader.dataset, batch_size=loader.batch_size, collate_fn=loader.collate_fn)


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
        """The stage's (first) dataloader, or ``None`` when there is none.

        Under a distributed sampler (DDP), a sequential loader over the same dataset, so every
        process reads the whole split.
        """
        if not self._loader_read:
            self._loader_read = True
            self._loader = _whole(_first_loader(self._stage_loaders()))
        return self._loader

    def _stage_loaders(self) -> Any:
        loop_name, loaders_name = _LOOPS.get(self.stage, ("", ""))
        loaders = getattr(self.trainer, loaders_name, None) if loaders_name else None
        loop = getattr(self.trainer, loop_name, None)
        if loaders is None and loop is not None:
            with torch.random.fork_rng(devices=[]):
                loop.setup_data()
            loaders = getattr(self.trainer, loaders_name, None)
        return loaders

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

    def examples(self) -> tuple[Tensor, Tensor | None] | None:
        """Every ``(x, y)`` of the stage's data, concatenated (one pass over the loader if needed).

        ``y`` is ``None`` for input-only batches; ``None`` without a loader.
        """
        dataset = self.dataset()
        if isinstance(dataset, TensorDataset):
            tensors = dataset.tensors
            return tensors[0], (tensors[1] if len(tensors) > 1 else None)
        loader = self.loader()
        if loader is None:
            return None
        xs: list[Tensor] = []
        ys: list[Tensor] = []
        for batch in loader:
            x, y = _split(batch)
            xs.append(x.detach().cpu())
            if y is not None:
                ys.append(y.detach().cpu())
        if not xs:
            return None
        return torch.cat(xs), (torch.cat(ys) if len(ys) == len(xs) else None)

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
