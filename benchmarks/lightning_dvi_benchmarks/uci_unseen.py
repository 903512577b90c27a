r"""Regression sets that ship inside installed packages, written in the UCI standard layout.

The six shared UCI sets chose the default protocol; a set none of those choices looked at tells
whether they carry over (issue 45). :func:`write_standard_layout` writes one such set as a
folder that :class:`lightning_dvi.data.UCIDataModule` and :mod:`lightning_dvi_benchmarks.uci`
read like any shared set: ``data.txt`` (inputs then target), ``index_features.txt``,
``index_target.txt``, and ``n_splits`` seeded random 90 % / 10 % train/test splits
(``index_train_K.txt``, ``index_test_K.txt``), the protocol of the shared splits.

:data:`UNSEEN_REGRESSION` names the sets: scikit-learn's bundled ``load_diabetes`` (442 rows,
10 inputs; read from the installed package, never downloaded). scikit-learn's California
housing is fetched from the network on first use, so it is not among them.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

__all__ = ["UNSEEN_REGRESSION", "diabetes_table", "write_standard_layout"]


def diabetes_table() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's diabetes data in original units: inputs ``[442, 10]`` and target ``[442]``."""
    from sklearn.datasets import load_diabetes

    data = load_diabetes(scaled=False)
    return np.asarray(data.data, dtype=np.float64), np.asarray(data.target, dtype=np.float64)


UNSEEN_REGRESSION: dict[str, Callable[[], tuple[np.ndarray, np.ndarray]]] = {
    "diabetes": diabetes_table,
}


def write_standard_layout(
    folder: str | Path,
    x: np.ndarray,
    y: np.ndarray,
    n_splits: int = 20,
    test_fraction: float = 0.1,
    seed: int = 0,
) -> Path:
    """Write ``(x, y)`` as a dataset folder in the UCI standard layout; returns the folder.

    Split ``k`` tests on the first ``round(test_fraction * N)`` rows of a permutation drawn
    from ``numpy.random.default_rng(seed + k)`` and trains on the rest, so every split is
    disjoint and covers all rows, and the folder is the same on every machine.

    Raises:
        ValueError: for mismatched shapes, ``n_splits < 1`` or a test fraction outside (0, 1).
    """
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64).reshape(-1)
    if x.ndim != 2 or x.shape[0] != y.shape[0]:
        raise ValueError(f"x must be [N, D] and y [N], got {x.shape} and {y.shape}")
    if n_splits < 1 or not 0.0 < test_fraction < 1.0:
        raise ValueError(
            f"need n_splits >= 1 and 0 < test_fraction < 1, got {n_splits}, {test_fraction}"
        )
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n, d = x.shape
    np.savetxt(folder / "data.txt", np.column_stack([x, y]), fmt="%.10g")
    (folder / "index_features.txt").write_text("".join(f"{i}\n" for i in range(d)))
    (folder / "index_target.txt").write_text(f"{d}\n")
    (folder / "n_splits.txt").write_text(f"{n_splits}\n")
    k_test = min(max(round(test_fraction * n), 1), n - 1)
    for k in range(n_splits):
        order = np.random.default_rng(seed + k).permutation(n)
        test, train = np.sort(order[:k_test]), np.sort(order[k_test:])
        (folder / f"index_train_{k}.txt").write_text("".join(f"{i}\n" for i in train))
        (folder / f"index_test_{k}.txt").write_text("".join(f"{i}\n" for i in test))
    return folder
