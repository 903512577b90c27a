"""Data: toy generator and LightningDataModules (toy, UCI, digits, your own tabular files).

Every DataModule exposes ``in_features`` and ``num_train`` (the ``N`` of ``KL / N``) right after
construction; regression ones also ``target_loc`` and ``target_scale`` (training statistics of
``y``) and ``x_loc``/``x_scale``. Batches are ``(x, y)`` tuples: float32 inputs, float32 targets
for regression and int64 labels for classification. Regression targets are in their original
units: :class:`~lightning_dvi.DVIRegressor` standardises them with ``target_loc``/``target_scale``
(a data module whose batches hold already-standardised targets sets ``targets_standardized =
True``). Those three members are the declared protocol
:class:`~lightning_dvi.transforms.TargetStatistics`, re-exported here for your own data modules.
"""

from ..transforms import TargetStatistics
from ._base import EpochSeededSampler, KnownTruth
from .csv import CSVDataModule, read_tabular
from .digits import DigitsDataModule
from .toy import make_toy_heteroscedastic, toy_mean, toy_noise_std, toy_true_log_likelihood
from .toy_module import ToyHeteroscedasticDataModule
from .uci import UCIDataModule, count_uci_splits

__all__ = [
    "CSVDataModule",
    "DigitsDataModule",
    "EpochSeededSampler",
    "KnownTruth",
    "TargetStatistics",
    "ToyHeteroscedasticDataModule",
    "UCIDataModule",
    "count_uci_splits",
    "make_toy_heteroscedastic",
    "read_tabular",
    "toy_mean",
    "toy_noise_std",
    "toy_true_log_likelihood",
]
