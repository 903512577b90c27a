"""Lightning front-end: LightningModules, the empirical-Bayes callback and plot callbacks."""

from ._network import register_network
from .callbacks import EmpiricalBayes, EmpiricalBayesRefresh
from .checkpoint import RunCheckpoint
from .classifier import DVIClassifier
from .plots import CalibrationPlot, PredictiveBandPlot, ReliabilityDiagram
from .progress import DVIProgressBar, ProgressLog
from .regressor import DVIRegressor
from .temperature import PredictiveCalibration, TemperatureScaling

__all__ = [
    "CalibrationPlot",
    "DVIClassifier",
    "DVIProgressBar",
    "DVIRegressor",
    "EmpiricalBayes",
    "EmpiricalBayesRefresh",
    "PredictiveBandPlot",
    "PredictiveCalibration",
    "ProgressLog",
    "ReliabilityDiagram",
    "RunCheckpoint",
    "TemperatureScaling",
    "register_network",
]
