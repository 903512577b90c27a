"""Argument checks of the Lightning front-end, in one place: each raises ``ValueError`` naming the argument."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TypeGuard, cast

from ..propagation import Mode, SamplePass, propagation

__all__ = [
    "check",
    "fraction",
    "is_int",
    "one_of",
    "optional_positive_int",
    "positive_float",
    "positive_int",
    "sampling",
]


def check(condition: bool, message: str) -> None:
    """Raise ``ValueError(message)`` unless ``condition``."""
    if not condition:
        raise ValueError(message)


def is_int(value: object) -> TypeGuard[int]:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def _finite_number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def positive_float(name: str, value: object, allow_zero: bool = False) -> float:
    """``value`` as a float, checked finite and ``> 0`` (``>= 0`` with ``allow_zero``)."""
    ok = _finite_number(value) and (value >= 0 if allow_zero else value > 0)
    check(ok, f"{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return float(cast(float, value))  # checked above


def positive_int(name: str, value: object) -> int:
    """``value`` checked to be an int ``>= 1``."""
    if is_int(value) and value >= 1:
        return value
    raise ValueError(f"{name} must be a positive int, got {value!r}")


def optional_positive_int(name: str, value: object, note: str = "") -> int | None:
    """``value`` checked to be ``None`` or an int ``>= 1`` (``note`` follows "or None")."""
    if value is None or (is_int(value) and value >= 1):
        return value
    raise ValueError(f"{name} must be a positive int or None{note}, got {value!r}")


def fraction(name: str, value: object) -> float:
    """``value`` as a float, checked to lie in ``[0, 1]``."""
    ok = _finite_number(value) and 0.0 <= value <= 1.0
    check(ok, f"{name} must be a fraction in [0, 1], got {value!r}")
    return float(cast(float, value))  # checked above


def one_of(name: str, value: object, choices: Sequence[str]) -> str:
    """``value`` checked to be one of the string ``choices``: ``name must be 'a' or 'b', got ...``."""
    if isinstance(value, str) and value in choices:
        return value
    raise ValueError(f"{name} must be {' or '.join(map(repr, choices))}, got {value!r}")


def sampling(mode: object, num_samples: object) -> tuple[Mode, int | None]:
    """The propagation ``mode`` and its network samples per step, as hyper-parameters.

    Built and checked by :func:`~lightning_dvi.propagation.propagation` (``num_samples``
    defaults to 1 in ``sample``/``local`` and must be unset in ``full``/``diag``).
    """
    how = propagation(cast(Mode, mode), cast("int | None", num_samples))
    return how.name, how.num_samples if isinstance(how, SamplePass) else None
