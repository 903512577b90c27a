"""Lightning callbacks: empirical Bayes, warm start, checkpoints, progress, plots, predictions, OOD, temperature.

A stable import path for YAML configs
(``class_path: lightning_dvi.callbacks.EmpiricalBayesRefresh``; ``EmpiricalBayes`` is its
deprecated former name);
the implementations live in :mod:`lightning_dvi.lightning`.
"""

from .lightning.callbacks import EmpiricalBayes, EmpiricalBayesRefresh
from .lightning.checkpoint import RunCheckpoint
from .lightning.early_stopping import PairedEarlyStopping, RestoreBestWeights
from .lightning.ood import OODEvaluation
from .lightning.plots import CalibrationPlot, PredictiveBandPlot, ReliabilityDiagram
from .lightning.predictions import PredictionWriter
from .lightning.progress import DVIProgressBar, ProgressLog
from .lightning.temperature import PredictiveCalibration, TemperatureScaling
from .lightning.warm_start import PointEstimateWarmStart

__all__ = [
    "CalibrationPlot",
    "DVIProgressBar",
    "EmpiricalBayes",
    "EmpiricalBayesRefresh",
    "OODEvaluation",
    "PairedEarlyStopping",
    "PointEstimateWarmStart",
    "PredictionWriter",
    "PredictiveBandPlot",
    "PredictiveCalibration",
    "ProgressLog",
    "ReliabilityDiagram",
    "RestoreBestWeights",
    "RunCheckpoint",
    "TemperatureScaling",
]
