"""Priors over BNN weights: a fixed Gaussian and the empirical-Bayes inverse-gamma hierarchy."""

from . import functional
from .base import GaussianPrior, Prior, named_parameter_groups
from .empirical_bayes import EmpiricalBayes

__all__ = ["EmpiricalBayes", "GaussianPrior", "Prior", "functional", "named_parameter_groups"]
