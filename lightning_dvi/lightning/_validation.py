"""Argument checks of the Lightning front-end, in one place: each raises ``ValueError`` naming the argument."""

from __future__ import annotations

import math
from typing import TypeGuard, cast

__all__ = ["check", "fraction", "is_int", "positive_float", "positive_int"]


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
    check(is_int(value) and value >= 1, f"{name} must be a positive int, got {value!r}")
    return cast(int, value)  # checked above


def fraction(name: str, value: object) -> float:
    """``value`` as a float, checked to lie in ``[0, 1]``."""
    ok = _finite_number(value) and 0.0 <= value <= 1.0
    check(ok, f"{name} must be a fraction in [0, 1], got {value!r}")
    return float(cast(float, value))  # checked above
