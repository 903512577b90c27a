"""Pyro front-end: swap ``AutoNormal`` / ``Trace_ELBO`` for DVI without changing the model.

``DeterministicGuide(model)`` and ``DeterministicELBO()`` replace ``AutoNormal(model)`` and
``Trace_ELBO()``; observed ``dist.Normal``, ``dist.Categorical(logits=f)``,
``dist.Bernoulli(logits=f)`` and ``dist.Poisson(rate=f.exp())`` sites, and the
``HeteroscedasticGaussian`` and ``Categorical`` distributions here, use the expected
log-likelihoods of :mod:`lightning_dvi.likelihoods`; ``PyroBayesNet`` exposes a declared
``lightning_dvi.nn`` network (skip connections included) to Pyro for full-covariance DVI.
"""

# The moment rules register themselves in the op table of .dispatch on import.
from . import moment_rules  # noqa: F401  (isort: keep first)
from .compiled_elbo import CompiledDeterministicELBO
from .distributions import Categorical, HeteroscedasticGaussian
from .elbo import DeterministicELBO
from .guide import DeterministicGuide, init_to_he
from .modules import PyroBayesNet
from .moment_tensor import MomentTensor
from .validation import ValidationCheckpoint, predictive_log_density, predictive_nll

__all__ = [
    "Categorical",
    "CompiledDeterministicELBO",
    "DeterministicELBO",
    "DeterministicGuide",
    "HeteroscedasticGaussian",
    "MomentTensor",
    "PyroBayesNet",
    "ValidationCheckpoint",
    "init_to_he",
    "predictive_log_density",
    "predictive_nll",
]
