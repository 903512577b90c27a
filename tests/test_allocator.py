"""Large-buffer reuse on glibc (issue 39, item 4): page faults of repeated large allocations.

Each check runs in a fresh interpreter (the thresholds are process-wide and set once) that
allocates a 100 MB covariance and its update ten times; with the allocator left alone every
block is mapped afresh (one minor fault per 4 KiB page), with reuse freed blocks come back from
the heap. Results, not timings: the page-fault counts from ``getrusage``.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from lightning_dvi.moments import allocator
from lightning_dvi.moments.allocator import reuse_large_allocations

glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

_CHILD = """
import importlib.util, resource, sys, torch
spec = importlib.util.spec_from_file_location("allocator", sys.argv[1])  # the module alone
allocator = importlib.util.module_from_spec(spec)
spec.loader.exec_module(allocator)
applied = allocator.reuse_large_allocations()
x = torch.randn(10_000, 50)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):  # a full-batch covariance and its update, 100 MB each, as in a DVI step
    c = torch.einsum("ni,nj->nij", x, x)
    c = c * 2.0
print(int(applied), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(malloc: str) -> tuple[bool, int]:
    env = {**os.environ, "LIGHTNING_DVI_MALLOC": malloc}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, allocator.__file__],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    applied, faults = (int(v) for v in out.stdout.split())
    return bool(applied), faults


@glibc
def test_reuse_keeps_large_blocks_instead_of_mapping_them_every_time():
    applied, reused = _faults("reuse")
    untouched, system = _faults("system")
    assert applied and not untouched
    assert system > 20 * (100_000_000 // 4096)  # every round maps and faults its blocks again
    assert reused < 0.75 * system  # 0.5-0.6 measured here; 0.04 on a whole UCI fit (docs)


def test_a_bad_setting_is_refused(monkeypatch):
    monkeypatch.setenv("LIGHTNING_DVI_MALLOC", "sometimes")
    with pytest.raises(ValueError, match="LIGHTNING_DVI_MALLOC must be 'reuse' or 'system'"):
        reuse_large_allocations()
