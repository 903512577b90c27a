"""Calibration metrics (torchmetrics ``Metric`` classes with sum states).

Regression metrics take a Gaussian predictive, ``update(mean, var, target)``; classification
metrics take class probabilities, ``update(probs, target)``. :class:`RegressionMetrics` and
:class:`ClassificationMetrics` bundle them with flat, ``log_dict``-ready names.
"""

from . import functional
from .classification import (
    BrierScore,
    ClassificationMetrics,
    ClassificationNLL,
    ExpectedCalibrationError,
    classification_metrics,
)
from .functional import ece_noise_floor
from .ood import (
    AURC,
    OODAUPR,
    OODAUROC,
    accuracy_rejection_curve,
    aurc,
    class_probability_samples,
    classification_summary,
    mutual_information,
    predictive_entropy,
)
from .regression import (
    RMSE,
    GaussianCRPS,
    GaussianNLL,
    IntervalCoverage,
    RegressionCalibrationError,
    RegressionMetrics,
    Sharpness,
    regression_metrics,
)

__all__ = [
    "AURC",
    "OODAUPR",
    "OODAUROC",
    "RMSE",
    "BrierScore",
    "ClassificationMetrics",
    "ClassificationNLL",
    "ExpectedCalibrationError",
    "GaussianCRPS",
    "GaussianNLL",
    "IntervalCoverage",
    "RegressionCalibrationError",
    "RegressionMetrics",
    "Sharpness",
    "accuracy_rejection_curve",
    "aurc",
    "class_probability_samples",
    "classification_metrics",
    "classification_summary",
    "ece_noise_floor",
    "functional",
    "mutual_information",
    "predictive_entropy",
    "regression_metrics",
]
