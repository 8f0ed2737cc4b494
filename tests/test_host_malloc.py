"""A CPU engine keeps freed heap memory, so a step's tensors do not fault fresh pages in."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds"
)

# In a fresh process: allocate, touch and free a 24 MiB tensor, then count the page faults
# a 16 MiB one takes to touch. (The first is larger so that the small allocations made in
# between, which may land in the freed space, leave room for the second.)
_PROBE = """
import resource, sys, torch
from cadence.engine.host_malloc import keep_freed_heap
if sys.argv[1] == "keep":
    assert keep_freed_heap()
torch.ones(6 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(4 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return int(done.stdout.split()[-1])


def test_second_step_sized_tensor_reuses_freed_pages() -> None:
    pages = (16 << 20) // 4096
    # glibc's default maps the first tensor apart and unmaps it on free; the second then
    # grows the heap onto fresh pages. The probe must see that, or it proves nothing.
    assert _faults("default") > pages // 2
    assert _faults("keep") < pages // 16
