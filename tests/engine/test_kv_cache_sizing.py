"""A CPU engine's KV cache is sized from facts of the machine and the model: the same at
every start, whatever is free at the moment (other work, or what dead servers left), and
the engines on one host together never take more than it has. CUDA's sizing is untouched.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import nn

from cadence.engine import machine_memory
from cadence.engine.engine_args import EngineArgs
from cadence.engine.engine_core import EngineCore
from cadence.engine.kv_cache_size import (
    kv_cache_budget_bytes,
    kv_cache_bytes_per_block,
    resolve_num_blocks,
)
from cadence.engine.loader import load_model
from cadence.engine.machine_memory import GiB, total_host_memory
from cadence.engine.weights_memory import host_weights_bytes
from cadence.server.disaggregation.topology import Topology

CPU = torch.device("cpu")
MiB = 1 << 20


def fake_meminfo(monkeypatch: pytest.MonkeyPatch, total: int, available: int | None) -> None:
    """/proc/meminfo as a machine of `total` bytes with `available` free (None: as now)."""
    real = machine_memory._meminfo

    def meminfo(field: str) -> int | None:
        if field == "MemTotal:":
            return total
        if field == "MemAvailable:" and available is not None:
            return available
        return real(field)

    monkeypatch.setattr(machine_memory, "_meminfo", meminfo)


def blocks(args: EngineArgs, weights: int, bytes_per_block: int = MiB) -> int:
    """Blocks for a cache nothing caps (every sequence of 32k tokens would use terabytes)."""
    return resolve_num_blocks(args, CPU, bytes_per_block, 32768, 1024, weights)


def test_the_cache_size_does_not_follow_available_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    args = EngineArgs(model="")
    found = []
    # What the issue saw: available memory fell from 23.4 to 11.5 GiB between restarts.
    for available in (int(23.4 * GiB), int(11.5 * GiB), 1 * GiB):
        fake_meminfo(monkeypatch, 32 * GiB, available)
        found.append(blocks(args, weights=2 * GiB))
    machine = total_host_memory()  # MemTotal, or a lower cgroup limit of this machine
    assert found == [(machine - 2 * GiB) // 4 // MiB] * 3


def test_engines_on_one_host_share_a_quarter_after_their_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_meminfo(monkeypatch, 32 * GiB, None)
    machine, weights = total_host_memory(), 1 * GiB
    engines = Topology(num_prefill=1, num_decode=2).engines(EngineArgs(model=""))
    assert {args.engines_per_host for args in engines.values()} == {3}
    budgets = [kv_cache_budget_bytes(args, CPU, weights)[0] for args in engines.values()]
    assert len(set(budgets)) == 1  # an equal split, whichever role
    assert sum(budgets) == pytest.approx((machine - 3 * weights) / 4, abs=4)
    assert sum(budgets) + 3 * weights <= machine
    (alone,) = Topology().engines(EngineArgs(model="")).values()
    assert alone.engines_per_host == 1
    assert kv_cache_budget_bytes(alone, CPU, weights)[0] == (machine - weights) // 4


def test_the_cache_is_capped_by_what_it_could_ever_use(monkeypatch: pytest.MonkeyPatch) -> None:
    fake_meminfo(monkeypatch, 64 * GiB, None)
    args = EngineArgs(model="", block_size=16)
    # 3 sequences (2 and a spare) of 64 tokens: 4 blocks each.
    assert resolve_num_blocks(args, CPU, MiB, 64, 2, weights_bytes=0) == 12


def test_weights_count_each_storage_once() -> None:
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, as many LM heads are
    model.register_buffer("scale", torch.ones(3, dtype=torch.float64))
    assert host_weights_bytes(model) == 10 * 4 * 4 + 3 * 8


@contextmanager
def leftover(nbytes: int) -> Iterator[None]:
    """Memory a dead server left: a file in memory (as its shared-memory KV was), which
    takes from what is available and not from what the machine has."""
    fd = os.memfd_create("cadence-test-leftover")
    try:
        os.posix_fallocate(fd, 0, nbytes)
        yield
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfds")
def test_an_engine_gets_the_same_cache_beside_leftovers(
    tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_dir("llama")
    args = EngineArgs(path, dtype="float32", max_model_len=64)
    model, config = load_model(path, torch.float32)
    spec = model.attention_spec()
    per_block = kv_cache_bytes_per_block(args, spec.num_kv_heads, spec.head_dim, torch.float32)
    per_block *= config.num_hidden_layers
    # A machine whose quarter after the weights is 100 blocks: fewer than 257 sequences of
    # 64 tokens could use, so memory decides the size.
    fake_meminfo(monkeypatch, host_weights_bytes(model) + 4 * 100 * per_block, None)

    def start() -> int:
        return EngineCore(args).num_kv_blocks

    first = start()
    with leftover(256 * MiB):
        second = start()
    assert first == second == 100
