"""Lightning callbacks: ``lightning_dvi.callbacks.EmpiricalBayesRefresh`` and the plot callbacks.

A stable import path for YAML configs
(``class_path: lightning_dvi.callbacks.EmpiricalBayesRefresh``; ``EmpiricalBayes`` is its
deprecated former name);
the implementations live in :mod:`lightning_dvi.lightning`.
"""

from .lightning.callbacks import EmpiricalBayes, EmpiricalBayesRefresh
from .lightning.ood import OODEvaluation
from .lightning.plots import CalibrationPlot, PredictiveBandPlot, ReliabilityDiagram
from .lightning.temperature import TemperatureScaling

__all__ = [
    "CalibrationPlot",
    "EmpiricalBayes",
    "EmpiricalBayesRefresh",
    "OODEvaluation",
    "PredictiveBandPlot",
    "ReliabilityDiagram",
    "TemperatureScaling",
]
