"""Reusable parts of the library's benchmarks (data splits, baselines, training protocols).

The recipes in ``recipes/`` stay short scripts over these; the parts are typed and tested.
"""

from . import classification, softmax_grid

__all__ = ["classification", "softmax_grid"]
