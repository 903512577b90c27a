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
    "classification_metrics",
    "functional",
    "regression_metrics",
]
