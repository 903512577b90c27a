"""Value checks (host reads) that a caller may defer to a cheaper check of its own result.

:func:`lightning_dvi.objective.elbo` checks that its loss is finite (one host read). A NaN or
Inf input or target makes that loss non-finite, so within the ELBO the per-call input and target
value checks (two more host reads and their reductions) are redundant on the hot path; the
ELBO runs them only when its loss is not finite, to name the cause. Everything else (shapes,
dtypes) is still checked on every call. Outside such a block every check runs as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["deferred_value_checks", "value_checks_enabled"]

_DEFERRED = [0]


@contextmanager
def deferred_value_checks(defer: bool = True) -> Iterator[None]:
    """Within the block (if ``defer``), input and target NaN/Inf checks are skipped.

    The caller promises a finite check of its own result, e.g. the ELBO's loss.
    """
    _DEFERRED[0] += defer
    try:
        yield
    finally:
        _DEFERRED[0] -= defer


def value_checks_enabled() -> bool:
    """Whether input and target values should be checked now (no deferring block is open)."""
    return _DEFERRED[0] == 0
