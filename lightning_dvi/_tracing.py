"""Whether a graph trace is under way (a leaf module: it imports only torch).

:func:`tracing` is what the library asks before a host read, a Python loop over blocks or a
cache of eager values; :mod:`lightning_dvi.moments.policy` re-exports it with the rest of the
execution policy.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch

__all__ = ["recording", "step_trace", "tracing", "untraced"]

_STEP_TRACE: ContextVar[bool] = ContextVar("lightning_dvi_step_trace", default=False)


def tracing() -> bool:
    """Whether a graph trace is under way: :func:`torch.compile`'s, or :func:`step_trace`'s.

    While it is, the library takes its trace-safe paths, exactly as under ``torch.compile``:
    no host reads (value checks and warnings are the caller's, outside the graph), no Python
    loop over blocks, autograd through the formulas instead of the fused Functions, no
    substitution caches.
    """
    return torch.compiler.is_compiling() or _STEP_TRACE.get()


@contextlib.contextmanager
def step_trace() -> Iterator[None]:
    """Within the block, :func:`tracing` is true: the library's whole-step graph trace.

    :class:`lightning_dvi.compile.CompiledStep` records a training step (forward and backward)
    as one aten graph with ``make_fx``, which runs the Python code once on tensors that record
    what they do; the code must then take the same trace-safe paths as under ``torch.compile``.
    """
    token = _STEP_TRACE.set(True)
    try:
        yield
    finally:
        _STEP_TRACE.reset(token)


def recording() -> bool:
    """Whether :func:`step_trace` is on: a whole step is being recorded (``make_fx``)."""
    return _STEP_TRACE.get()


@contextlib.contextmanager
def untraced() -> Iterator[None]:
    """Within the block, a whole-step recording records nothing: values are read on the host.

    For facts about the *model*, not the data, that the library reads from tensor values while
    it builds a step: whether a prior's mean is zero, or which rows and columns a shape op
    keeps (its index probes). They are the same at every call of a recorded graph, so they are
    decided while recording, from real values, and enter the graph as constants. Code inside
    must not compute on the step's inputs. Outside a ``make_fx`` recording it changes nothing.
    """
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    with disable_proxy_modes_tracing():
        yield
