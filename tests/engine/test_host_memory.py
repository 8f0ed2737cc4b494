"""A CPU engine keeps freed heap memory, so a step's tensors do not fault fresh pages in,
and takes its KV cache on pages the OS backs only when written."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from cadence.engine import engine_core, host_memory, model_runner
from cadence.engine.engine_args import EngineArgs
from cadence.engine.engine_core import EngineCore
from cadence.engine.host_memory import zeroed_pages

on_glibc = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc thresholds"
)
on_linux = pytest.mark.skipif(platform.system() != "Linux", reason="reads /proc/self/statm")

# In a fresh process with huge pages off (where they are on for all memory, glibc's
# mapped blocks would take a few huge-page faults instead of thousands): allocate, touch
# and free a 24 MiB tensor, then count the page faults a 16 MiB one takes to touch. The
# first is the larger so that the small allocations made in between, which may land in
# the freed space, leave room for the second.
_PROBE = """
import ctypes, resource, sys
ctypes.CDLL("libc.so.6").prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE
import torch
from cadence.engine.host_memory import keep_freed_heap
print(keep_freed_heap() if sys.argv[1] == "keep" else None)
torch.ones(6 << 20)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.ones(4 << 20)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(mode: str, **env: str) -> tuple[str, int]:
    """(what keep_freed_heap returned, the second tensor's page faults)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "LD_PRELOAD")}
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, mode], capture_output=True, text=True, timeout=120, env={**clean, **env}
    )
    assert done.returncode == 0, done.stderr
    applied, faults = done.stdout.split()[-2:]
    return applied, int(faults)


@on_glibc
def test_second_step_sized_tensor_reuses_freed_pages() -> None:
    pages = (16 << 20) // 4096
    # glibc's default maps the first tensor apart and unmaps it on free; the second then
    # grows the heap onto fresh pages. The probe must see that, or it proves nothing.
    assert _probe("default")[1] > pages // 2
    applied, faults = _probe("keep")
    assert applied == "True" and faults < pages // 16


@on_glibc
def test_the_users_own_malloc_settings_stand() -> None:
    tunables = "glibc.malloc.trim_threshold=65536"
    assert _probe("keep", GLIBC_TUNABLES=tunables)[0] == "False"
    assert _probe("keep", MALLOC_TRIM_THRESHOLD_="65536")[0] == "False"


def test_a_cpu_engine_keeps_its_heap_and_takes_its_cache_on_zeroed_pages(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], str]
) -> None:
    kept: list[bool] = []
    cache_shapes: list[tuple[int, ...]] = []

    def keep() -> bool:
        kept.append(True)
        return True

    monkeypatch.setattr(engine_core, "keep_freed_heap", keep)

    def recorded(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        cache_shapes.append(shape)
        return zeroed_pages(shape, dtype)

    monkeypatch.setattr(model_runner, "zeroed_pages", recorded)
    core = EngineCore(EngineArgs(tiny_model_dir("llama"), dtype="float32", max_model_len=64, num_gpu_blocks=64))
    assert kept == [True]
    caches = [cache for cache in core.runner.kv_caches if isinstance(cache, torch.Tensor)]
    assert len(cache_shapes) == len(caches) == len(core.runner.kv_caches) > 0
    assert cache_shapes == [tuple(cache.shape) for cache in caches]


def _resident_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@on_linux
def test_zeroed_pages_read_zero_and_are_backed_only_where_written() -> None:
    size = 256 << 20
    before = _resident_bytes()
    cache = zeroed_pages((2, size // 2 // 4), torch.float32)
    assert cache.shape == (2, size // 2 // 4) and cache.dtype == torch.float32 and cache.nbytes == size
    assert _resident_bytes() - before < 16 << 20  # torch.zeros writes all 256 MiB
    rows = cache.view(-1, 64)
    rows.index_copy_(0, torch.tensor([3, 100_000]), torch.ones(2, 64))
    assert bool((rows[[3, 100_000]] == 1).all())
    assert not rows[::1024].any()  # reading unwritten pages backs none of them
    assert _resident_bytes() - before < 16 << 20


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8])
def test_zeroed_pages_take_any_cache_dtype(dtype: torch.dtype) -> None:
    cache = zeroed_pages((3, 5, 16), dtype)
    assert cache.dtype == dtype and cache.shape == (3, 5, 16) and cache.is_contiguous()
    assert not cache.float().any()
    assert zeroed_pages((0, 4), dtype).shape == (0, 4)


def test_keep_freed_heap_is_a_no_op_off_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_applied", False)
    monkeypatch.setattr(host_memory.platform, "libc_ver", lambda: ("", ""))
    assert host_memory.keep_freed_heap() is False
