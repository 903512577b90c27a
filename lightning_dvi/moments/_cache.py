"""One per-process cache of small constant tensors that tracing never pollutes.

:func:`cached` guards every such cache in :mod:`lightning_dvi.moments` (the quadrature rules'
node tensors of :func:`._quadrature.constant`, the head's pair indices of :mod:`.linear`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, MutableMapping
from typing import TypeVar

import torch
from torch import Tensor

from . import policy

__all__ = ["cached"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")  # a tensor or a tuple of tensors


def cached(cache: MutableMapping[K, V], key: K, build: Callable[[], V]) -> V:
    """``build()``, kept in ``cache`` under ``key`` only when that is safe.

    * While compiled or exported (``torch.compile``, ``torch.export``) the value is built
      fresh on every call: a constant of the traced graph, never cached.
    * A value with a tensor that is not a plain ``torch.Tensor`` (a tracer's fake or functional
      tensor, e.g. an export before any eager call) is returned but not cached, so a later
      eager call never receives it.
    * Values are built outside inference mode, so autograd may save them after a first call
      in a validation or predict loop.
    """
    if policy.tracing() or torch.compiler.is_exporting():
        return build()
    hit = cache.get(key)
    if hit is None:
        with torch.inference_mode(False):
            hit = build()
        parts: tuple[object, ...] = hit if isinstance(hit, tuple) else (hit,)
        if any(type(t) is not Tensor for t in parts):
            return hit
        cache[key] = hit
    return hit
