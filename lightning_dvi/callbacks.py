"""Lightning callbacks: ``lightning_dvi.callbacks.EmpiricalBayes`` and the plot callbacks.

A stable import path for YAML configs (``class_path: lightning_dvi.callbacks.EmpiricalBayes``);
the implementations live in :mod:`lightning_dvi.lightning`.
"""

from .lightning.callbacks import EmpiricalBayes
from .lightning.ood import OODEvaluation
from .lightning.plots import CalibrationPlot, PredictiveBandPlot, ReliabilityDiagram

__all__ = [
    "CalibrationPlot",
    "EmpiricalBayes",
    "OODEvaluation",
    "PredictiveBandPlot",
    "ReliabilityDiagram",
]
