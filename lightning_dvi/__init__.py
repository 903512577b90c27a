"""lightning_dvi: deterministic variational inference for Bayesian neural networks."""

from .gaussian import Gaussian

__version__ = "0.1.0.dev0"

__all__ = ["Gaussian", "__version__"]

# The LightningModules load lazily: `import lightning_dvi` must not import Lightning (the core
# never depends on it).
_LAZY_LIGHTNING = ("DVIClassifier", "DVIRegressor")
__all__ += list(_LAZY_LIGHTNING)


def __getattr__(name: str) -> object:
    """Import the LightningModules on first access (PEP 562)."""
    if name in _LAZY_LIGHTNING:
        from . import lightning as _lightning_front_end

        return getattr(_lightning_front_end, name)
    raise AttributeError(f"module 'lightning_dvi' has no attribute {name!r}")
