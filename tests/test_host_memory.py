"""A CPU engine keeps freed heap memory, so a step's tensors do not fault fresh pages in,
and takes its KV cache on pages the OS backs only when written."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest
import torch

from cadence.engine.host_memory import zeroed_pages

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds"
)

# In a fresh process: allocate, touch and free a 24 MiB tensor, then count the page faults
# a 16 MiB one takes to touch. (The first is larger so that the small allocations made in
# between, which may land in the freed space, leave room for the second.)
_PROBE = """
import resource, sys, torch
from cadence.engine.host_memory import keep_freed_heap
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


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_zeroed_pages_read_zero_and_are_backed_only_where_written() -> None:
    size = 256 << 20
    before = _resident_bytes()
    cache = zeroed_pages((2, size // 8 // 4), torch.float32)
    assert cache.shape == (2, size // 8 // 4) and cache.dtype == torch.float32
    assert _resident_bytes() - before < 16 << 20  # torch.zeros would have written all 256 MiB
    rows = cache.view(-1, 64)
    rows.index_copy_(0, torch.tensor([3, 100_000]), torch.ones(2, 64))
    assert _resident_bytes() - before < 16 << 20  # 2 rows written, a page or two backed
    assert bool((rows[[3, 100_000]] == 1).all()) and not rows[[0, 4, 99_999, 200_000]].any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_zeroed_pages_take_any_cache_dtype(dtype: torch.dtype) -> None:
    cache = zeroed_pages((3, 5, 16), dtype)
    assert cache.dtype == dtype and cache.shape == (3, 5, 16) and cache.is_contiguous()
    assert not cache.float().any()
    assert zeroed_pages((0, 4), dtype).shape == (0, 4)
