"""LightningDataModule for the paper's toy 1-D heteroscedastic regression data (no files)."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor
from torch.utils.data import TensorDataset

from ._base import InMemoryDataModule
from .toy import make_toy_heteroscedastic, toy_mean, toy_noise_std, toy_true_log_likelihood

__all__ = ["ToyHeteroscedasticDataModule"]


class ToyHeteroscedasticDataModule(InMemoryDataModule):
    """The toy data of :func:`~lightning_dvi.data.toy.make_toy_heteroscedastic`, split three ways.

    Each split is an independent draw: the train, validation and test sets use three seeds
    derived from ``seed`` by a seeded generator (so neighbouring ``seed`` values do not share
    draws). Data are not standardised: ``target_loc = 0``, ``target_scale = 1``, ``x_loc = [0]``,
    ``x_scale = [1]``. Batches are ``(x [B, 1] float32, y [B] float32)``.

    Args:
        num_train: training-set size ``N`` (the ``N`` of ``KL / N``).
        num_val: validation-set size; 0 disables validation.
        num_test: test-set size; 0 leaves the test loader empty.
        batch_size: mini-batch size for every loader.
        seed: seeds the data draws and the training-set shuffling.
        predict_on: what ``predict_dataloader`` yields: ``"grid"``, ``num_grid`` evenly spaced
            inputs over ``[-0.5, 0.5]`` paired with the noiseless mean function (for plots), or
            ``"test"``, the test set.
        num_grid: number of grid points for ``predict_on="grid"``.

    Examples:
        >>> dm = ToyHeteroscedasticDataModule(num_train=64, batch_size=16)
        >>> dm.in_features, dm.num_train, dm.target_scale
        (1, 64, 1.0)
    """

    def __init__(
        self,
        num_train: int = 500,
        num_val: int = 100,
        num_test: int = 500,
        batch_size: int = 100,
        seed: int = 0,
        predict_on: Literal["grid", "test"] = "grid",
        num_grid: int = 200,
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed)
        if num_train < 1:
            raise ValueError(f"num_train must be positive, got {num_train}")
        if num_val < 0 or num_test < 0:
            raise ValueError(f"num_val and num_test must be >= 0, got {num_val} and {num_test}")
        if predict_on not in ("grid", "test"):
            raise ValueError(f"predict_on must be 'grid' or 'test', got {predict_on!r}")
        if num_grid < 2:
            raise ValueError(f"num_grid must be at least 2, got {num_grid}")
        # the requested sizes; num_train/num_val/num_test report the built splits
        self._sizes = (num_train, num_val, num_test)
        self.predict_on = predict_on
        self.num_grid = num_grid
        self.in_features = 1
        self.target_loc = 0.0
        self.target_scale = 1.0
        self.x_loc = torch.zeros(1)
        self.x_scale = torch.ones(1)

    def _split_seeds(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed)
        return torch.randint(0, 2**31 - 1, (3,), generator=generator).tolist()

    def _build(self) -> dict[str, TensorDataset | None]:
        train_seed, val_seed, test_seed = self._split_seeds()

        def draw(n: int, seed: int) -> TensorDataset | None:
            return TensorDataset(*make_toy_heteroscedastic(n, seed)) if n > 0 else None

        num_train, num_val, num_test = self._sizes
        test = draw(num_test, test_seed)
        return {
            "train": draw(num_train, train_seed),
            "val": draw(num_val, val_seed),
            "test": test,
            "predict": TensorDataset(*self.grid()) if self.predict_on == "grid" else test,
        }

    def grid(self) -> tuple[Tensor, Tensor]:
        """``(x [num_grid, 1], noiseless mean [num_grid])`` over ``[-0.5, 0.5]``, float32."""
        x = torch.linspace(-0.5, 0.5, self.num_grid, dtype=torch.float64).unsqueeze(-1)
        return x.float(), toy_mean(x[:, 0]).float()

    def true_mean_and_noise_std(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(toy_mean(x), toy_noise_std(x))``: the data's truth (:class:`~lightning_dvi.data.KnownTruth`).

        Examples:
            >>> mean, std = ToyHeteroscedasticDataModule().true_mean_and_noise_std(torch.zeros(1))
            >>> bool(std > 0)
            True
        """
        return toy_mean(x), toy_noise_std(x)

    def reference_metrics(self) -> dict[str, float]:
        """Reference values the CLI prints next to the test metrics (a data module's hook).

        The toy data know their true noise model, so the best test NLL any fit can reach:
        ``{"true noise model test NLL": -mean log p(y | x)}`` on the test split (empty without
        one).
        """
        test = self.test_dataset
        if test is None:
            return {}
        return {"true noise model test NLL": -float(toy_true_log_likelihood(*test.tensors))}
