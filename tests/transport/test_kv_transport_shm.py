"""The shared-memory KV transport: caches in memfds, read by other processes.

A load must copy exactly the blocks it names (every other byte of the reader's cache
stays as it was), see writes the exporter made after the reader mapped its memory, refuse
a source laid out otherwise without writing anything, and report a source whose process
closed its transport, ended or was killed as an error rather than raise, hang or read
what the dead engine left. Nothing may stay behind: no descriptor after `close`, and no
mapping of a dead exporter's memory after the reader's next load.
Contents are random bytes compared as bytes, so any dtype (and NaN patterns) compare.
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import signal
import tempfile
from collections.abc import Callable
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

import pytest
import torch

from cadence.engine.attention.backend import KVCache
from cadence.engine.kv_transfer.process_identity import own_start_time
from cadence.engine.kv_transfer.shared_memory import SharedMemoryTransport
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.model_runner import TensorFactory, allocate_kv_cache
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult
from tests.support.kv_transport_checks import (
    BLOCK_SIZE,
    CPU,
    HEAD_DIM,
    NUM_KV_HEADS,
    NUM_LAYERS,
    assert_bytes,
    expect_copied,
    fill,
    layout,
    snapshot,
    tensors,
)
from tests.support.shm_checks import descriptors, holders, mappings

pytestmark = pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfds")

KV_CACHE_DTYPES = ("auto", "int8")


def make_caches(
    zeros: TensorFactory, kv_cache_dtype: str, num_blocks: int = 12, head_dim: int = HEAD_DIM
) -> list[KVCache]:
    shape = (2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    return [allocate_kv_cache(shape, torch.float32, kv_cache_dtype, CPU, zeros) for _ in range(NUM_LAYERS)]


def plain_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, device=device)


def prefix_of(source: KVSource) -> str:
    """The name its memfds start with."""
    return json.loads(source.address.removeprefix("shm:"))["prefix"]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_load_copies_exactly_the_named_blocks(kv_cache_dtype: str) -> None:
    exporter, reader = SharedMemoryTransport(), SharedMemoryTransport()
    source_caches = make_caches(exporter.zeros, kv_cache_dtype)
    assert all(torch.count_nonzero(tensor) == 0 for tensor in tensors(source_caches)), "zeros() zero-fills"
    target = make_caches(reader.zeros, kv_cache_dtype, num_blocks=10)  # block counts may differ
    fill(source_caches, seed=1)
    fill(target, seed=2)
    source = exporter.export(source_caches, layout(kv_cache_dtype))
    assert isinstance(source.address, str) and source.transport == "shared-memory"
    assert descriptors(os.getpid(), prefix_of(source)) == len(tensors(source_caches))

    expected = expect_copied(snapshot(target), source_caches, [7, 2, 11], [0, 5, 9])
    reader.start_load(KVLoad("a", source, [7, 2, 11], [0, 5, 9]), target)
    assert reader.poll() == [KVLoadResult("a", 3)]
    assert reader.poll() == []
    assert_bytes(target, expected)

    # The reader keeps its mapping; what the exporter writes later is what the next load sees.
    fill(source_caches, seed=3)
    expected = expect_copied(snapshot(target), source_caches, [4], [1])
    reader.start_load(KVLoad("b", source, [4], [1]), target)
    reader.cancel("b")  # over already: a no-op
    assert reader.poll() == [KVLoadResult("b", 1)]
    assert_bytes(target, expected)

    # A transport closed in a process that lives on is gone for its readers all the same.
    exporter.close()
    assert descriptors(os.getpid(), prefix_of(source)) == 0
    before = snapshot(target)
    reader.start_load(KVLoad("c", source, [4], [1]), target)
    [result] = reader.poll()
    assert result.num_blocks_loaded == 0 and "closed" in str(result.error), result
    assert_bytes(target, before)
    reader.close()
    assert descriptors(os.getpid(), reader.prefix) == 0
    fill(source_caches, seed=4)  # the exporter's own tensors outlive its memfds


@pytest.mark.parametrize(
    ("kv_cache_dtype", "options", "load"),
    [
        ("int8", {}, ([1], [1])),  # values and scales here, values only in the source
        ("auto", {"head_dim": 4}, ([1], [1])),
        ("auto", {}, ([12], [0])),  # past the source's blocks
        ("auto", {}, ([0, 1], [2])),
    ],
)
def test_a_source_that_does_not_fit_is_refused_unwritten(
    kv_cache_dtype: str, options: dict[str, int], load: tuple[list[int], list[int]]
) -> None:
    exporter, reader = SharedMemoryTransport(), SharedMemoryTransport()
    source_caches = make_caches(exporter.zeros, "auto")
    fill(source_caches, seed=1)
    source = exporter.export(source_caches, layout("auto"))
    target = make_caches(plain_zeros, kv_cache_dtype, **options)
    fill(target, seed=2)
    before = snapshot(target)
    reader.start_load(KVLoad("r", source, *load), target)
    [result] = reader.poll()
    assert result.num_blocks_loaded == 0 and result.error
    assert_bytes(target, before)
    exporter.close()


def address_of(pid: int, start: int, fd: int) -> str:
    """An address that names one float32 tensor of 4 in descriptor `fd` of process `pid`."""
    prefix = f"cadence-kv-{pid}-{'0' * 32}"
    data = {"pid": pid, "start": start, "prefix": prefix, "tensors": [[0, fd, "float32", [4]]]}
    return "shm:" + json.dumps(data)


def test_foreign_addresses_and_devices_are_refused() -> None:
    transport = SharedMemoryTransport()
    target = make_caches(plain_zeros, "auto")
    layout_ = layout("auto")
    read, write = os.pipe()  # opening a pipe's read end would wait for a writer
    with tempfile.TemporaryFile() as plain:
        addresses = [
            "in-process:x",
            'shm:{"pid":1,"start":0,"prefix":"passwd","tensors":[]}',
            "shm:{",
            # This live process, but not as started: a reused pid is another process.
            address_of(os.getpid(), own_start_time() + 1, plain.fileno()),
            # This very process, and descriptors that are not memfds of ours.
            address_of(os.getpid(), own_start_time(), plain.fileno()),
            address_of(os.getpid(), own_start_time(), read),
        ]
        for address in addresses:
            transport.start_load(KVLoad("r", KVSource("shared-memory", address, layout_), [0], [0]), target)
    os.close(read)
    os.close(write)
    transport.start_load(KVLoad("r", "not a source", [0], [0]), target)
    results = transport.poll()
    assert [r.num_blocks_loaded for r in results] == [0] * 7 and all(r.error for r in results)
    assert "ended" in str(results[3].error)
    with pytest.raises(ValueError, match="CPU"):
        transport.zeros((2, 3), torch.float32, torch.device("cuda"))
    with pytest.raises(ValueError, match="allocated"):
        transport.export(target, layout_)


def test_memfds_close_with_a_dropped_transport() -> None:
    transport = SharedMemoryTransport()
    tensor = transport.zeros((4, 4), torch.float32, CPU)
    prefix = transport.prefix
    assert descriptors(os.getpid(), prefix) == 1
    del transport
    gc.collect()
    assert descriptors(os.getpid(), prefix) == 0
    tensor += 1  # still mapped
    del tensor
    gc.collect()
    assert mappings(os.getpid(), prefix) == 0  # and then the kernel frees it


def export_in_child(sources: Queue, done: Event) -> None:
    """A prefill engine's half in another process: known contents in a plain and a
    quantized cache, exported, held until told (or killed)."""
    transports = []
    for kv_cache_dtype in KV_CACHE_DTYPES:
        transport = SharedMemoryTransport()
        caches = make_caches(transport.zeros, kv_cache_dtype)
        fill(caches, seed=7)
        sources.put((kv_cache_dtype, transport.export(caches, layout(kv_cache_dtype))))
        transports.append(transport)
    done.wait(300)
    for transport in transports:
        transport.close()


@pytest.mark.parametrize("ending", ["close", "kill"])
def test_a_source_whose_exporter_ended_is_an_error_and_its_memory_goes(ending: str) -> None:
    # One child for both cache kinds: a spawned child spends seconds importing torch.
    context = multiprocessing.get_context("spawn")
    queue, done = context.Queue(), context.Event()
    child = context.Process(target=export_in_child, args=(queue, done), daemon=True)
    child.start()
    assert child.pid is not None
    theirs = f"cadence-kv-{child.pid}-"
    reader = SharedMemoryTransport()
    loaded = {}
    ended = False
    try:
        sources: dict[str, KVSource] = dict(queue.get(timeout=120) for _ in KV_CACHE_DTYPES)
        for kv_cache_dtype, source in sources.items():
            known = make_caches(plain_zeros, kv_cache_dtype)
            fill(known, seed=7)
            target = make_caches(plain_zeros, kv_cache_dtype, num_blocks=6)
            fill(target, seed=8)
            expected = expect_copied(snapshot(target), known, [3, 10, 0], [5, 0, 2])
            reader.start_load(KVLoad(kv_cache_dtype, source, [3, 10, 0], [5, 0, 2]), target)
            assert reader.poll() == [KVLoadResult(kv_cache_dtype, 3)]
            assert_bytes(target, expected)
            loaded[kv_cache_dtype] = (source, target, expected)
        # The child holds its memfds open; the reader maps them and keeps no descriptor.
        assert holders(theirs) == {child.pid, os.getpid()}
        assert descriptors(os.getpid(), theirs) == 0
        if ending == "kill":
            os.kill(child.pid, signal.SIGKILL)
        else:
            done.set()  # never after a kill: setting waits for the killed waiter to wake
        ended = True
    finally:
        if not ended:  # a failure above: leave no child behind
            child.kill()
        child.join(60)
    assert child.exitcode == (0 if ending == "close" else -signal.SIGKILL)
    # The reader's mapping is all that keeps the memory now, until its next load from any source.
    assert holders(theirs) == {os.getpid()}
    live = SharedMemoryTransport()
    live_source = live.export(make_caches(live.zeros, "auto"), layout("auto"))
    reader.start_load(KVLoad("live", live_source, [0], [0]), make_caches(plain_zeros, "auto"))
    assert reader.poll() == [KVLoadResult("live", 1)]
    assert holders(theirs) == set(), "the kernel frees the memory once nothing holds it"
    live.close()
    fresh = SharedMemoryTransport()  # one that never mapped the source finds nothing either
    for source, target, expected in loaded.values():
        for transport in (reader, fresh):
            transport.start_load(KVLoad("late", source, [1], [1]), target)
            [result] = transport.poll()
            assert result.num_blocks_loaded == 0 and "ended" in str(result.error), result
            assert_bytes(target, expected)


def test_engines_over_shared_memory_match_colocated(tiny_model_dir: Callable[[str], str]) -> None:
    # Imported here, not above: the spawned child imports this module, and needs no engine.
    from cadence.engine.protocol import EngineCoreRequest
    from cadence.engine.sampling_params import SamplingParams
    from cadence.server.disaggregation.local_cluster import LocalCluster
    from tests.engine.test_disaggregation import Tokens, collect, engine, run

    model = tiny_model_dir("llama")
    options = {"num_gpu_blocks": 200, "kv_transport": "shared-memory"}
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    requests = [
        EngineCoreRequest(f"p{n}", [(n * 7 + i * 13) % 499 + 1 for i in range(n)], params)
        for n in (10, 37, 64, 100, 130)
    ]
    colocated = engine(model, num_gpu_blocks=200)
    for request in requests:
        colocated.add_request(request)
    reference: Tokens = {}
    while colocated.has_unfinished_requests():
        collect(colocated.step, reference, {})
    prefill, decode = engine(model, "prefill", **options), engine(model, "decode", **options)
    cluster = LocalCluster([prefill], [decode])
    tokens, _ = run(cluster, requests)
    assert tokens == reference
    assert cluster.coordinator.stats.num_remote_prefills == len(requests)
    assert prefill.kv_source is not None and prefill.kv_source.transport == "shared-memory"
    for core in (prefill, decode):
        core.close()
    assert descriptors(os.getpid(), prefix_of(prefill.kv_source)) == 0
