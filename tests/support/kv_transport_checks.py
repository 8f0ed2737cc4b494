"""Byte-level checks shared by the KV transport tests: caches of random bytes, and what a
load of some blocks must leave in the reader's caches (every other byte as it was)."""

from __future__ import annotations

import time

import torch

from cadence.engine.attention.backend import KVCache, split_kv_cache
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.transport import KVTransport
from cadence.engine.model_runner import allocate_kv_cache
from cadence.scheduler.remote_kv import KVLoadResult

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 4, 2, 8
CPU = torch.device("cpu")


def tensors(caches: list[KVCache]) -> list[torch.Tensor]:
    return [tensor for cache in caches for tensor in split_kv_cache(cache) if tensor is not None]


def fill(caches: list[KVCache], seed: int) -> None:
    """Random bytes, the same for a seed in any process."""
    generator = torch.Generator().manual_seed(seed)
    for tensor in tensors(caches):
        raw = tensor.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=generator))


def snapshot(caches: list[KVCache]) -> list[torch.Tensor]:
    return [tensor.view(torch.uint8).clone() for tensor in tensors(caches)]


def expect_copied(
    before: list[torch.Tensor], source: list[KVCache], remote: list[int], local: list[int]
) -> list[torch.Tensor]:
    expected = [tensor.clone() for tensor in before]
    for target, tensor in zip(expected, tensors(source), strict=True):
        target[:, local] = tensor.view(torch.uint8)[:, remote]
    return expected


def assert_bytes(caches: list[KVCache], expected: list[torch.Tensor]) -> None:
    actual = snapshot(caches)
    assert len(actual) == len(expected)
    for ours, theirs in zip(actual, expected):
        assert torch.equal(ours, theirs)


def layout(kv_cache_dtype: str) -> KVLayout:
    return KVLayout("test", NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, "float32", kv_cache_dtype)


def make_caches(
    kv_cache_dtype: str, num_blocks: int = 12, num_layers: int = NUM_LAYERS, head_dim: int = HEAD_DIM
) -> list[KVCache]:
    """Plain CPU caches of the tests' geometry."""
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    return [allocate_kv_cache(shape, torch.float32, kv_cache_dtype, CPU) for _ in range(num_layers)]


def wait_for(transport: KVTransport, count: int, seconds: float = 10.0) -> list[KVLoadResult]:
    """Poll until `count` loads are reported; fail, never hang, past the deadline."""
    results: list[KVLoadResult] = []
    deadline = time.monotonic() + seconds
    while len(results) < count:
        assert time.monotonic() < deadline, f"only {results} reported within {seconds} s"
        results += transport.poll()
        time.sleep(0.001)
    return results
