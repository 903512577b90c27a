"""LightningDataModule for scikit-learn's bundled 8x8 digits (offline, 1797 images, 10 classes)."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch.utils.data import TensorDataset

from ._base import InMemoryDataModule, fit_standardizer

__all__ = ["DigitsDataModule"]


class DigitsDataModule(InMemoryDataModule):
    """scikit-learn's ``load_digits`` with a seeded, stratified train/validation/test split.

    The 64 pixel features are standardised with training statistics (pixels that are constant
    on the training set, such as the always-blank corners, get scale 1). Batches are
    ``(x [B, 64] float32, y [B] int64)``, or with ``images=True`` ``x [B, 1, 8, 8]`` (the same
    standardised pixels in image layout, for :class:`~lightning_dvi.nn.CNN`);
    ``predict_dataloader`` yields the test set. ``in_features`` stays 64 (pixels per image).

    Args:
        batch_size: mini-batch size for every loader.
        val_fraction: fraction of all images held out for validation; 0 disables validation.
        test_fraction: fraction of all images held out for testing, in ``(0, 1)``.
        seed: seeds the split and the training-set shuffling.
        images: yield inputs as ``[1, 8, 8]`` images instead of 64-vectors.
        standardize: ``"pixel"`` (each pixel by its own training mean and std) or
            ``"global"`` (one mean and std over all training pixels, the usual choice for
            convolutional networks: per-pixel scaling turns a stroke on a nearly always blank
            pixel into a value of up to 86 standard deviations).

    Examples:
        >>> dm = DigitsDataModule()
        >>> dm.in_features, dm.num_classes, dm.num_train
        (64, 10, 1258)
    """

    num_classes: int = 10
    in_features: int = 64

    def __init__(
        self,
        batch_size: int = 128,
        val_fraction: float = 0.1,
        test_fraction: float = 0.2,
        seed: int = 0,
        images: bool = False,
        standardize: str = "pixel",
    ) -> None:
        super().__init__(batch_size=batch_size, seed=seed)
        if not (math.isfinite(val_fraction) and 0.0 <= val_fraction < 1.0):
            raise ValueError(f"val_fraction must lie in [0, 1), got {val_fraction}")
        if not (math.isfinite(test_fraction) and 0.0 < test_fraction < 1.0):
            raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
        if val_fraction + test_fraction >= 1.0:
            raise ValueError(
                "val_fraction + test_fraction must stay below 1 so that a training set is "
                f"left, got {val_fraction} + {test_fraction}"
            )
        self.val_fraction = val_fraction
        self.test_fraction = test_fraction
        self.images = bool(images)
        if standardize not in ("pixel", "global"):
            raise ValueError(f"standardize must be 'pixel' or 'global', got {standardize!r}")
        self.standardize = standardize
        self._x_loc: torch.Tensor | None = None
        self._x_scale: torch.Tensor | None = None

    @property
    def x_loc(self) -> torch.Tensor:
        """Per-pixel training means, float32 ``[64]``."""
        self._datasets()
        assert self._x_loc is not None
        return self._x_loc.clone()

    @property
    def x_scale(self) -> torch.Tensor:
        """Per-pixel training standard deviations (1 for constant pixels), float32 ``[64]``."""
        self._datasets()
        assert self._x_scale is not None
        return self._x_scale.clone()

    def ood_inputs(self, kind: str = "permuted", seed: int = 0) -> torch.Tensor:
        """Out-of-distribution inputs, one per test image, in the layout of the test inputs.

        Both kinds live on the scale of the standardised digits (each training pixel has mean
        0 and variance 1), so a detector cannot win by input magnitude alone:

        * ``"permuted"``: each standardised test digit with its 64 pixels shuffled by one
          fixed random permutation (the same values, no digit shape);
        * ``"noise"``: independent standard normal pixels.

        Args:
            kind: ``"permuted"`` or ``"noise"``.
            seed: seeds the permutation or the noise.

        Returns:
            float32 ``[N_test, 64]`` (or ``[N_test, 1, 8, 8]`` with ``images=True``).

        Examples:
            >>> DigitsDataModule().ood_inputs("noise").shape
            torch.Size([359, 64])
        """
        test = self.test_dataset
        assert test is not None
        x = test.tensors[0].reshape(-1, 64)
        gen = torch.Generator().manual_seed(seed)
        if kind == "permuted":
            out = x[:, torch.randperm(64, generator=gen)]
        elif kind == "noise":
            out = torch.randn(x.shape, generator=gen)
        else:
            raise ValueError(f"kind must be 'permuted' or 'noise', got {kind!r}")
        return out.reshape(-1, 1, 8, 8) if self.images else out

    def _build(self) -> dict[str, TensorDataset | None]:
        # scikit-learn costs ~1 s to import: only a run that reads digits pays it
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        x, y = load_digits(return_X_y=True)
        rows = np.arange(y.size)
        num_test = round(self.test_fraction * y.size)
        num_val = round(self.val_fraction * y.size)
        # Stratified, so every split keeps the (nearly uniform) class balance.
        rest, test = train_test_split(rows, test_size=num_test, stratify=y, random_state=self.seed)
        if num_val > 0:
            train, val = train_test_split(
                rest, test_size=num_val, stratify=y[rest], random_state=self.seed
            )
        else:
            train, val = rest, rest[:0]
        if self.standardize == "global":
            values = x[train]
            loc = np.full(x.shape[1], values.mean())
            scale = np.full(x.shape[1], values.std())
        else:
            loc, scale = fit_standardizer(x[train])
        self._x_loc = torch.as_tensor(loc, dtype=torch.float32)
        self._x_scale = torch.as_tensor(scale, dtype=torch.float32)

        def subset(idx: np.ndarray) -> TensorDataset | None:
            if idx.size == 0:
                return None
            inputs = torch.as_tensor((x[idx] - loc) / scale, dtype=torch.float32)
            if self.images:
                inputs = inputs.reshape(-1, 1, 8, 8)
            return TensorDataset(inputs, torch.as_tensor(y[idx], dtype=torch.long))

        test_set = subset(np.sort(test))
        return {
            "train": subset(np.sort(train)),
            "val": subset(np.sort(val)),
            "test": test_set,
            "predict": test_set,
        }
