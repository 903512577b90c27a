r"""Execution policy for memory: reuse large CPU buffers instead of mapping them for every step.

A full-batch DVI evaluation allocates ``[N, D, D]`` covariance temporaries of hundreds of
megabytes and frees them again, every evaluation. glibc's ``malloc`` serves any block above
its mmap threshold (at most 32 MiB by default) with a fresh ``mmap`` and returns it with
``munmap`` on free, so each evaluation maps, zero-fills page by page (one minor fault per 4 KiB
page) and unmaps the same memory again: on the protein set (41,000 training rows) a split spent
37.8 s in the kernel for 344.6 s of user time, with 8.9 million page faults.

:func:`reuse_large_allocations` raises glibc's mmap and trim thresholds (``mallopt``), so such
blocks come from the heap and go back to it on free, where the next evaluation reuses them.
Measured on the same split (``recipes/uci_benchmark.py --dataset protein --method dvi --splits
1``, 2-core AMD EPYC, torch 2.13.0+cpu, 1 thread): system time 37.8 s -> 2.6 s (11 % -> 0.8 %
of user time), page faults 8.9 M -> 0.32 M, CPU time per split 13 % lower, the same test
log-likelihood to every printed digit. The cost: memory freed by the process is kept for
reuse rather than returned to the system, so the resident size stays near its peak.

The Lightning modules apply it when a fit starts on a CPU (once per process). It does nothing
off glibc (macOS, Windows, musl). Env ``LIGHTNING_DVI_MALLOC`` = ``system`` leaves the
allocator alone (read when a fit starts); ``reuse`` is the default.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "reuse_large_allocations"]

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3  # glibc's mallopt parameters

MMAP_THRESHOLD = 2**31 - 1
"""Blocks below this many bytes come from the heap (glibc's default: at most 32 MiB)."""

TRIM_THRESHOLD = 2**31 - 1
"""Free memory at the top of the heap is returned to the system only above this many bytes."""

_TOP_PAD = 64 * 2**20

_log = logging.getLogger(__name__)
_applied: dict[str, bool] = {}


def reuse_large_allocations(enabled: bool | None = None) -> bool:
    """Let glibc keep large freed blocks for reuse (see the module docstring); once per process.

    Args:
        enabled: ``True`` to apply, ``False`` to leave the allocator alone; ``None`` reads env
            ``LIGHTNING_DVI_MALLOC`` (``reuse``, the default, or ``system``).

    Returns:
        Whether the thresholds are set in this process (now or by an earlier call).

    Raises:
        ValueError: for another value of ``LIGHTNING_DVI_MALLOC``.
    """
    if enabled is None:
        value = os.environ.get("LIGHTNING_DVI_MALLOC", "reuse").strip().lower()
        if value not in ("reuse", "system"):
            raise ValueError(f"LIGHTNING_DVI_MALLOC must be 'reuse' or 'system', got {value!r}")
        enabled = value == "reuse"
    if not enabled:
        return _applied.get("done", False)
    if "done" in _applied:
        return _applied["done"]
    done = False
    if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
        try:
            mallopt = ctypes.CDLL(None).mallopt
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            done = all(
                mallopt(param, value) == 1
                for param, value in (
                    (_M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                    (_M_TRIM_THRESHOLD, TRIM_THRESHOLD),
                    (_M_TOP_PAD, _TOP_PAD),
                )
            )
        except (OSError, AttributeError):
            done = False
    _applied["done"] = done
    if done:
        _log.info(
            "glibc malloc keeps blocks up to 2 GiB in the heap (LIGHTNING_DVI_MALLOC=system to stop)"
        )
    return done
