"""Observation models on the network's output Gaussian: expected log-likelihoods and predictives.

``functional`` holds the closed forms as pure tensor functions; the classes wire them to
:class:`~lightning_dvi.Gaussian` outputs and ``torch.distributions`` predictives.
"""

from . import functional, logistic_normal, predictive
from .base import ExportOptions, Likelihood, PredictiveHead, RegressionHead
from .bernoulli import Bernoulli
from .categorical import Categorical
from .config import SHORTHANDS, likelihood_config, register_likelihood, resolve_likelihood
from .gaussian import (
    HeteroscedasticGaussian,
    HeteroscedasticPredictive,
    HomoscedasticGaussian,
    NoiseBoundWarning,
)
from .poisson import Poisson, PoissonLogNormal

__all__ = [
    "SHORTHANDS",
    "Bernoulli",
    "Categorical",
    "ExportOptions",
    "HeteroscedasticGaussian",
    "HeteroscedasticPredictive",
    "HomoscedasticGaussian",
    "Likelihood",
    "NoiseBoundWarning",
    "Poisson",
    "PoissonLogNormal",
    "PredictiveHead",
    "RegressionHead",
    "functional",
    "likelihood_config",
    "logistic_normal",
    "predictive",
    "register_likelihood",
    "resolve_likelihood",
]
