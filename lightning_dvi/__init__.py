"""lightning_dvi: deterministic variational inference for Bayesian neural networks."""

from .gaussian import Gaussian

__version__ = "0.1.0.dev0"

__all__ = ["Gaussian", "__version__"]
