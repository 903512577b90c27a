"""Lightning front-end: LightningModules, the empirical-Bayes callback and plot callbacks."""

from .callbacks import EmpiricalBayes, EmpiricalBayesRefresh
from .classifier import DVIClassifier
from .plots import CalibrationPlot, PredictiveBandPlot, ReliabilityDiagram
from .regressor import DVIRegressor
from .temperature import TemperatureScaling

__all__ = [
    "CalibrationPlot",
    "DVIClassifier",
    "DVIRegressor",
    "EmpiricalBayes",
    "EmpiricalBayesRefresh",
    "PredictiveBandPlot",
    "ReliabilityDiagram",
    "TemperatureScaling",
]
