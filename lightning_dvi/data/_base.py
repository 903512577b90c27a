"""Plumbing shared by the in-memory DataModules: lazy loading, loaders, standardisation."""

from __future__ import annotations

from collections.abc import Iterator, Sized
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from torch.utils.data import DataLoader, RandomSampler, TensorDataset

from ..transforms import location_scale

__all__ = [
    "EpochSeededSampler",
    "GatherTensorDataset",
    "InMemoryDataModule",
    "KnownTruth",
    "ResumableDataLoader",
    "fit_standardizer",
]


@runtime_checkable
class KnownTruth(Protocol):
    """A datamodule of generated data that knows its true regression function and noise.

    Plots and reports draw the truth next to a fit when the datamodule declares it (the toy
    data do); nothing else depends on it.
    """

    def true_mean_and_noise_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(E[y | x], std[y | x])`` at 1-D inputs ``x`` (original units, any shape)."""
        ...


class GatherTensorDataset(TensorDataset):
    """A ``TensorDataset`` whose batches are one index per tensor, not a stack of rows.

    ``DataLoader`` asks a dataset with ``__getitems__`` for a whole batch of indices at once;
    this one answers with ``[t[indices] for t in tensors]``, the same values in the same order
    as collating the rows one by one (``default_collate`` stacks them), for one gather per
    tensor instead of a Python loop over the rows. On a UCI-size full batch (1,000 rows) the
    row loop cost more than the network's forward and backward pass. Use it with
    :func:`gathered` as the loader's ``collate_fn``.
    """

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        """The rows ``indices`` of every tensor, in that order."""
        index = torch.as_tensor(indices, dtype=torch.long)
        return [tensor[index] for tensor in self.tensors]


def gathered(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The ``collate_fn`` of a :class:`GatherTensorDataset`: its batch is already collated."""
    return batch


def _gathering(dataset: TensorDataset) -> GatherTensorDataset:
    # Built when a loader is made, so tensors swapped into the dataset before then are used.
    if isinstance(dataset, GatherTensorDataset):
        return dataset
    return GatherTensorDataset(*dataset.tensors)


class EpochSeededSampler(RandomSampler):
    """A random permutation per epoch, drawn from a generator seeded with ``seed + epoch``.

    Lightning calls ``set_epoch`` before every training epoch, so a run resumed from a checkpoint
    sees the same order as an uninterrupted one (a single generator advanced epoch by epoch would
    restart from its seed on resume). Without ``set_epoch`` calls each new pass takes the next
    epoch. Subclassing ``RandomSampler`` keeps Lightning's DDP sampler replacement shuffling.

    Args:
        data_source: the dataset to permute.
        seed: base seed.
    """

    def __init__(self, data_source: Sized, seed: int) -> None:
        super().__init__(data_source, generator=torch.Generator())
        self.seed = seed
        self.epoch = 0
        self._epoch_was_set = False

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` on the next pass."""
        self.epoch = epoch
        self._epoch_was_set = True

    def __iter__(self) -> Iterator[int]:
        assert self.generator is not None
        self.generator.manual_seed(self.seed + self.epoch)
        if not self._epoch_was_set:
            self.epoch += 1
        self._epoch_was_set = False
        return super().__iter__()


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` that resumes mid-epoch: Lightning's stateful-loader protocol.

    Lightning saves ``state_dict()`` of stateful train loaders in every checkpoint and calls
    ``load_state_dict()`` before iterating again on resume. The state is the number of batches
    already yielded in the current pass; a resumed pass skips that many (the sampler gives the
    same permutation, being seeded per epoch) so a run killed mid-epoch continues with exactly
    the batches it would have seen. Lightning does not prefetch from sized loaders, so at a
    checkpoint the batches yielded are the batches trained on.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._yielded = 0
        self._skip = 0

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]  # a generator over DataLoader's iterator
        # A generator: nothing happens until Lightning's first next(), after set_epoch.
        iterator = super().__iter__()
        skip, self._skip = self._skip, 0
        for _ in range(skip):
            next(iterator)
        self._yielded = skip
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, int]:
        """Batches yielded so far in the current pass."""
        return {"batches_yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Skip the batches a previous run already trained on in its unfinished pass."""
        done = int(state.get("batches_yielded", 0))
        # a finished pass (an end-of-epoch checkpoint) starts the next epoch from its beginning
        self._skip = done if 0 < done < len(self) else 0


def fit_standardizer(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Column means and standard deviations (``ddof=0``) of ``values [N, D]``, in float64.

    :func:`lightning_dvi.transforms.location_scale` (the one fitting function, which the
    regressor's outcome transform also uses) on a numpy array: constant columns get scale 1,
    columns whose sums overflow float64 are summed in units of their largest magnitude.
    """
    loc, scale = location_scale(torch.from_numpy(np.asarray(values, dtype=np.float64)))
    return loc.numpy(), scale.numpy()


class InMemoryDataModule(LightningDataModule):
    """A DataModule whose splits are ``TensorDataset`` objects built once, on first use.

    Subclasses implement :meth:`_build`, returning the ``train``, ``val``, ``test`` and
    ``predict`` datasets (``val``/``test`` may be ``None`` when empty). Loading happens on the
    first call to :meth:`setup` or to any property that needs the data, so attributes like
    ``num_train`` can be read right after construction (LightningCLI links read them then).

    Attributes:
        targets_standardized: whether the batches hold standardised regression targets
            (``False`` for every built-in module: targets stay in their original units and the
            regressor standardises them with ``target_loc``/``target_scale``). With those two
            a regression module satisfies :class:`~lightning_dvi.transforms.TargetStatistics`,
            which the regressor and the CLI read.
    """

    targets_standardized: bool = False

    def __init__(self, batch_size: int, seed: int) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        self.batch_size = batch_size
        self.seed = seed
        self._splits: dict[str, TensorDataset | None] | None = None

    def _build(self) -> dict[str, TensorDataset | None]:
        raise NotImplementedError

    def _datasets(self) -> dict[str, TensorDataset | None]:
        if self._splits is None:
            self._splits = self._build()
        return self._splits

    def setup(self, stage: str | None = None) -> None:
        """Build the datasets (once; later calls do nothing)."""
        self._datasets()

    @property
    def train_dataset(self) -> TensorDataset:
        """The training split as ``(x, y)`` pairs."""
        dataset = self._datasets()["train"]
        assert dataset is not None
        return dataset

    @property
    def val_dataset(self) -> TensorDataset | None:
        """The validation split, or ``None`` when there is none."""
        return self._datasets()["val"]

    @property
    def test_dataset(self) -> TensorDataset | None:
        """The test split, or ``None`` when there is none."""
        return self._datasets()["test"]

    @property
    def num_train(self) -> int:
        """Training examples actually trained on: the ``N`` of ``KL / N``."""
        return len(self.train_dataset)

    @property
    def num_val(self) -> int:
        """Validation examples (0 without a validation split)."""
        return 0 if self.val_dataset is None else len(self.val_dataset)

    @property
    def num_test(self) -> int:
        """Test examples (0 without a test split)."""
        return 0 if self.test_dataset is None else len(self.test_dataset)

    def _loader(self, dataset: TensorDataset | None) -> DataLoader | list[DataLoader]:
        # An empty list is how Lightning is told that a stage has no data: it skips the loop.
        if dataset is None or len(dataset) == 0:
            return []
        return DataLoader(
            _gathering(dataset),
            batch_size=self.batch_size,
            shuffle=False,
            num_workers=0,
            collate_fn=gathered,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled training batches (:class:`EpochSeededSampler` seeded with ``seed``).

        The loader is a :class:`ResumableDataLoader`, so a run killed mid-epoch resumes from
        its last checkpoint with exactly the remaining batches. Batches are gathered with one
        index per tensor (:class:`GatherTensorDataset`), so a full batch costs one gather,
        not a loop over its rows.

        Under DDP Lightning swaps in its ``DistributedSampler``, which shuffles with the seed
        of ``seed_everything`` instead.
        """
        dataset = _gathering(self.train_dataset)
        sampler = EpochSeededSampler(dataset, self.seed)
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=0,
            collate_fn=gathered,
        )

    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        """Validation batches in order; ``[]`` (no validation) when the split is empty."""
        return self._loader(self.val_dataset)

    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        """Test batches in order; ``[]`` when the split is empty."""
        return self._loader(self.test_dataset)

    def predict_dataloader(self) -> DataLoader | list[DataLoader]:
        """Prediction batches in order: ``(x, y)`` pairs (see the subclass for which set)."""
        return self._loader(self._datasets()["predict"])
