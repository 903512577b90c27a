"""Pyro front-end: swap ``AutoNormal`` / ``Trace_ELBO`` for DVI without changing the model.

``DeterministicGuide(model)`` and ``DeterministicELBO()`` replace ``AutoNormal(model)`` and
``Trace_ELBO()``.
"""

from .elbo import DeterministicELBO
from .guide import DeterministicGuide
from .moment_tensor import MomentTensor

__all__ = ["DeterministicELBO", "DeterministicGuide", "MomentTensor"]
