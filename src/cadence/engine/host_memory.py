"""How a CPU engine takes host memory from the OS: freed activations stay, the KV cache
arrives zeroed page by page.

Freed memory. A CPU step allocates and frees its activations through the C heap: at a
1,024-token prefill, tens of tensors of several MiB each per layer. glibc's defaults hand
such memory back to the kernel as soon as it is freed: a block above the mmap threshold
is unmapped on ``free``, and a heap top above the trim threshold is cut off. The next
step's tensors then start on fresh pages, and the kernel zeroes each page on its first
touch. The threshold glibc raises on its own follows only the largest block freed so far,
so steps whose sizes change (a prefill chunk beside a varying number of decodes) keep
paying. Raising both thresholds once keeps the freed pages for the next step; the peak the
process holds stays what its largest step needs (bench/RESULTS.md has the measurement).
vLLM's CPU backend gets the same from tcmalloc through ``LD_PRELOAD``.

The KV cache. ``torch.zeros`` writes every byte, so a cache sized from free memory (GiBs)
took seconds at start and was resident at once, used or not. Anonymous pages from
``mmap`` read as zero and are backed only when first written, so the cache costs nothing
until requests fill it.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import platform

import torch

logger = logging.getLogger(__name__)

# mallopt parameters, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc caps the mmap threshold at half its heap size on 64-bit: blocks larger than this
# are mapped apart whatever is set.
_MMAP_THRESHOLD = 32 << 20
# Freed memory stays until the heap's free top exceeds this (2 GiB - 1: an int).
_TRIM_THRESHOLD = (1 << 31) - 1

_applied = False


def _allocator_chosen_by_user() -> str | None:
    """What in the environment already sets the process's allocator policy, if anything:
    a preloaded allocator (whose heap mallopt would not reach) or glibc's own malloc
    settings. The user's choice stands."""
    preload = os.environ.get("LD_PRELOAD", "")
    for allocator in ("tcmalloc", "jemalloc", "mimalloc"):
        if allocator in preload:
            return f"LD_PRELOAD has {allocator}"
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES sets malloc"
    for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"):
        if name in os.environ:
            return f"{name} is set"
    return None


def keep_freed_heap() -> bool:
    """Raise glibc's mmap and trim thresholds for this process, once; whether they are
    raised. They are not off glibc, nor where the environment already chose the
    allocator's policy. They stay for the life of the process, which includes the
    caller's own code when the engine runs in it (the offline ``LLM``)."""
    global _applied
    if _applied:
        return True
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    chosen = _allocator_chosen_by_user()
    if chosen is not None:
        logger.info("CPU engine: malloc thresholds left as they are (%s)", chosen)
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    # Both or neither: setting one turns off glibc's self-raising threshold, and that
    # alone, with the other threshold at its default, made CPU steps about twice as slow.
    if not libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD):
        logger.warning("could not raise glibc's mmap threshold; CPU steps may fault freed memory back in")
        return False
    if not libc.mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD):  # glibc takes any int: not seen to fail
        logger.error("glibc took the mmap threshold but not the trim threshold; CPU steps may run slower")
        return False
    _applied = True
    logger.info("CPU engine: freed heap memory stays in the process (glibc mmap threshold 32 MiB, no trimming)")
    return True


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor on anonymous pages the OS backs when first written (see the
    module doc); the tensor keeps its mapping alive."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # Private, as malloc's memory is: unwritten pages read as the shared zero page and
    # take no memory, huge pages follow the system's setting, and a fork copies on write.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE) if hasattr(mmap, "MAP_PRIVATE") else mmap.mmap(-1, nbytes)
    # As bytes first: frombuffer has no fp8 dtypes, and a byte view takes any dtype.
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)
