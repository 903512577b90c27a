r"""Detecting a collapsed classification predictive: too uncertain for how well the network fits.

A Bayesian classifier whose KL term wins over the data has a predictive that flattens toward
uniform (entropy near :math:`\log K`) while the posterior-mean network still classifies its
training rows well: the posterior variance, not the network, is what is wrong. Fano's
inequality makes "too uncertain" precise: a predictor that is right with probability :math:`a`
and calibrated has mean predictive entropy at most

.. math::
    H_{\max}(a) = h(1 - a) + (1 - a)\log(K - 1),\qquad h(e) = -e\log e - (1-e)\log(1-e),

so a validation entropy above :math:`H_{\max}` of the validation accuracy is under-confident
for that accuracy. :class:`~lightning_dvi.DVIClassifier` logs ``val/entropy_ratio``
(:math:`\bar H/\log K`), ``val/entropy_excess`` (:math:`\bar H - H_{\max}`, nats) and
``train/accuracy`` (the posterior-mean network on up to :data:`PROBE_ROWS` training rows) every
validation epoch, and warns once per fit when :func:`is_collapsed` has held at
:data:`PATIENCE` validation checks in a row over which the entropy did not fall by
:data:`FALL` (times :math:`\log K`) or more (:func:`persists`): an untrained network is
uncertain for its first epochs too, but then its entropy falls quickly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset, TensorDataset, default_collate

__all__ = [
    "ENTROPY_RATIO",
    "FALL",
    "PATIENCE",
    "PROBE_ROWS",
    "TRAIN_ACCURACY",
    "collapse_message",
    "fano_entropy_bound",
    "is_collapsed",
    "persists",
    "probe_rows",
]

#: Training rows (evenly spaced over the training set) on which ``train/accuracy`` is measured.
PROBE_ROWS = 512
#: A collapse needs the validation entropy to be at least this fraction of :math:`\log K` ...
ENTROPY_RATIO = 0.5
#: ... while the posterior-mean network classifies at least this fraction of the probe rows.
TRAIN_ACCURACY = 0.8
#: Consecutive validation checks that must find a collapse before the warning.
PATIENCE = 3
#: ... over which the entropy fell by less than this fraction of :math:`\log K`.
FALL = 0.05


def fano_entropy_bound(accuracy: float, num_classes: int) -> float:
    r""":math:`H_{\max}(a)`: the largest mean entropy of a calibrated predictor with accuracy ``a`` (nats).

    Examples:
        >>> round(fano_entropy_bound(0.1, 10), 4) == round(math.log(10), 4)  # chance level
        True
        >>> fano_entropy_bound(1.0, 10)
        0.0
    """
    e = min(max(1.0 - accuracy, 0.0), 1.0)
    binary = -sum(p * math.log(p) for p in (e, 1.0 - e) if p > 0)
    return binary + e * math.log(num_classes - 1) if num_classes > 1 else 0.0


def is_collapsed(
    entropy: float, val_accuracy: float, train_accuracy: float | None, num_classes: int
) -> bool:
    """Whether the validation predictive has collapsed at one check (the module docstring's conditions).

    ``entropy`` is the mean validation predictive entropy (nats); ``train_accuracy`` ``None``
    (no training rows to probe) drops the condition on it.
    """
    if entropy < ENTROPY_RATIO * math.log(num_classes):
        return False
    if entropy <= fano_entropy_bound(val_accuracy, num_classes):
        return False
    return train_accuracy is None or train_accuracy >= TRAIN_ACCURACY


def persists(entropies: Sequence[float], num_classes: int) -> bool:
    r"""Whether consecutive collapsed checks with these entropies call for the warning.

    At least :data:`PATIENCE` of them, and over the last :data:`PATIENCE` the entropy fell by
    less than :data:`FALL` times :math:`\log K` (a network still learning gets more certain).
    """
    if len(entropies) < PATIENCE:
        return False
    return entropies[-1] > entropies[-PATIENCE] - FALL * math.log(num_classes)


def collapse_message(
    owner: str,
    entropy: float,
    val_accuracy: float,
    train_accuracy: float | None,
    num_classes: int,
    epoch: int,
    advice: str,
) -> str:
    """The warning: what was measured, the likely cause, and the argument to change (``advice``)."""
    fit = (
        ""
        if train_accuracy is None
        else f", while the posterior-mean network classifies {train_accuracy:.0%} of its "
        "training rows correctly"
    )
    return (
        f"{owner}: the predictive has collapsed toward uniform at epoch {epoch}: mean "
        f"validation predictive entropy {entropy:.2f} nats ({entropy / math.log(num_classes):.0%} "
        f"of log K), above the {fano_entropy_bound(val_accuracy, num_classes):.2f} nats a "
        f"calibrated predictor with the validation accuracy {val_accuracy:.2f} can have{fit}. "
        f"The KL term is flattening the predictive (logged: val/entropy_ratio, "
        f"val/entropy_excess, train/accuracy). {advice}"
    )


def probe_rows(dataset: Dataset | None, rows: int = PROBE_ROWS) -> tuple[Tensor, Tensor] | None:
    """Up to ``rows`` evenly spaced ``(x, y)`` of a map-style training dataset, or ``None``.

    A :class:`~torch.utils.data.TensorDataset` is sliced; another dataset with a length is
    indexed and collated with the default collate function. No loader is iterated (a resumable
    training loader keeps its position).
    """
    try:
        size = len(dataset)  # type: ignore[arg-type]  # None or an iterable dataset raise TypeError
    except TypeError:
        return None
    if size == 0:
        return None
    index = torch.linspace(0, size - 1, min(rows, size)).round().long().unique()
    if isinstance(dataset, TensorDataset):
        if len(dataset.tensors) < 2:
            return None
        return dataset.tensors[0][index], dataset.tensors[1][index]
    assert dataset is not None
    try:
        batch = default_collate([dataset[int(i)] for i in index])
    except (TypeError, RuntimeError, IndexError, KeyError):
        return None
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        return None
    x, y = batch[0], batch[1]
    return (x, y) if isinstance(x, Tensor) and isinstance(y, Tensor) else None
