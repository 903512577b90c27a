"""Priors over BNN weights: a fixed Gaussian and the empirical-Bayes inverse-gamma hierarchy."""

from . import functional
from .base import GaussianPrior, Prior, named_parameter_groups
from .config import SHORTHANDS, prior_config, register_prior, resolve_prior
from .empirical_bayes import EmpiricalBayes

__all__ = [
    "SHORTHANDS",
    "EmpiricalBayes",
    "GaussianPrior",
    "Prior",
    "functional",
    "named_parameter_groups",
    "prior_config",
    "register_prior",
    "resolve_prior",
]
