"""The NIXL KV transport (UCX), between agents in one process, across processes, and
under real engines.

A load must copy exactly the blocks it names (every other byte of the reader's cache
stays as it was), refuse a source laid out otherwise without writing anything, report a
cancelled load once, and turn a source whose process died into an error result within
seconds, never an exception or a hang. Contents are random bytes compared as bytes.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue

import pytest

pytest.importorskip("nixl_cu12", reason="the NIXL transport needs the nixl_cu12 package")

from cadence.engine.kv_transfer.nixl import NixlTransport
from cadence.engine.kv_transfer.source import KVSource
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult
from cadence.server.disaggregation.local_cluster import LocalCluster
from tests.support.kv_transport_checks import (
    assert_bytes,
    expect_copied,
    fill,
    layout,
    make_caches,
    snapshot,
    wait_for,
)


@pytest.fixture(scope="module")
def nixl_works() -> None:
    """Skip, saying why, where NIXL is installed but cannot make a UCX agent."""
    try:
        NixlTransport().close()
    except Exception as error:  # noqa: BLE001 - whatever stops an agent is the reason to skip
        pytest.skip(f"NIXL cannot create an agent with the UCX backend here: {error}")


@pytest.fixture
def make_transport(nixl_works: None) -> Iterator[Callable[..., NixlTransport]]:
    made: list[NixlTransport] = []

    def make(exporting: bool = True) -> NixlTransport:
        made.append(NixlTransport(exporting))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_load_copies_exactly_the_named_blocks(
    make_transport: Callable[..., NixlTransport], kv_cache_dtype: str
) -> None:
    exporter, reader = make_transport(), make_transport(exporting=False)
    source_caches = make_caches(kv_cache_dtype)
    target = make_caches(kv_cache_dtype, num_blocks=10)  # block counts may differ
    fill(source_caches, seed=1)
    fill(target, seed=2)
    source = exporter.export(source_caches, layout(kv_cache_dtype))
    assert isinstance(source.address, str) and source.transport == "nixl"

    # Blocks back to back on both sides (2, 3, 4 -> 5, 6, 7) move as one run; the rest alone.
    remote, local = [7, 2, 3, 4, 11, 0], [0, 5, 6, 7, 9, 8]
    expected = expect_copied(snapshot(target), source_caches, remote, local)
    reader.start_load(KVLoad("a", source, remote, local), target)
    assert wait_for(reader, 1) == [KVLoadResult("a", 6)]
    assert reader.poll() == []
    assert_bytes(target, expected)

    # The same source again (its agent added once): what the exporter wrote since is read.
    fill(source_caches, seed=3)
    expected = expect_copied(snapshot(target), source_caches, [4, 5], [1, 2])
    reader.start_load(KVLoad("b", source, [4, 5], [1, 2]), target)
    assert wait_for(reader, 1) == [KVLoadResult("b", 2)]
    assert_bytes(target, expected)


@pytest.mark.parametrize(
    ("kv_cache_dtype", "options", "load"),
    [
        ("int8", {}, ([1], [1])),  # values and scales here, values only in the source
        ("auto", {"num_layers": 2}, ([1], [1])),
        ("auto", {"head_dim": 4}, ([1], [1])),
        ("auto", {}, ([12], [0])),  # past the source's blocks
        ("auto", {}, ([0], [12])),  # past ours
        ("auto", {}, ([0, 1], [2])),
    ],
)
def test_a_source_that_does_not_fit_is_refused_unwritten(
    make_transport: Callable[..., NixlTransport],
    kv_cache_dtype: str,
    options: dict[str, int],
    load: tuple[list[int], list[int]],
) -> None:
    exporter, reader = make_transport(), make_transport(exporting=False)
    source_caches = make_caches("auto")
    source = exporter.export(source_caches, layout("auto"))
    target = make_caches(kv_cache_dtype, **options)
    fill(target, seed=2)
    before = snapshot(target)
    reader.start_load(KVLoad("r", source, *load), target)
    [result] = wait_for(reader, 1)
    assert result.request_id == "r" and result.num_blocks_loaded == 0 and result.error
    assert_bytes(target, before)


def test_foreign_sources_are_refused(make_transport: Callable[..., NixlTransport]) -> None:
    reader = make_transport(exporting=False)
    target = make_caches("auto")
    with pytest.raises(ValueError, match="reading only"):
        reader.export(target, layout("auto"))
    for source in [KVSource("shared-memory", "{}", layout("auto")), KVSource("nixl", "{", layout("auto")), "x"]:
        reader.start_load(KVLoad("r", source, [0], [0]), target)
    results = wait_for(reader, 3)
    assert [r.num_blocks_loaded for r in results] == [0] * 3 and all(r.error for r in results)


def test_a_cancelled_load_is_reported_once(make_transport: Callable[..., NixlTransport]) -> None:
    exporter, reader = make_transport(), make_transport(exporting=False)
    source = exporter.export(make_caches("auto"), layout("auto"))
    target = make_caches("auto")
    reader.start_load(KVLoad("c", source, list(range(12)), list(range(12))), target)
    reader.cancel("c")
    reader.cancel("unknown")  # no load of that name: nothing happens
    assert wait_for(reader, 1) == [KVLoadResult("c", 0, "cancelled")]
    time.sleep(0.05)
    assert reader.poll() == []


def export_in_child(sources: Queue) -> None:
    """A prefill engine's half in another process: known contents in a plain and a
    quantized cache, exported, held until killed (waiting on no lock a kill would break)."""
    held = []  # one transport per engine, and so per cache kind; both outlive their exports
    for kv_cache_dtype in ("auto", "int8"):
        transport, caches = NixlTransport(), make_caches(kv_cache_dtype)
        fill(caches, seed=7)
        sources.put((kv_cache_dtype, transport.export(caches, layout(kv_cache_dtype))))
        held.append((transport, caches))
    time.sleep(60)


def test_loads_across_processes_and_from_a_killed_source(make_transport: Callable[..., NixlTransport]) -> None:
    # One child for both cache kinds: a spawned child spends seconds importing torch.
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=export_in_child, args=(queue,), daemon=True)
    child.start()
    try:
        sources: dict[str, KVSource] = dict(queue.get(timeout=60) for _ in range(2))
        readers, targets = {}, {}  # a reader per cache kind, as each engine has one transport
        for kv_cache_dtype, source in sources.items():
            readers[kv_cache_dtype] = reader = make_transport(exporting=False)
            known = make_caches(kv_cache_dtype)
            fill(known, seed=7)
            targets[kv_cache_dtype] = target = make_caches(kv_cache_dtype, num_blocks=6)
            fill(target, seed=8)
            expected = expect_copied(snapshot(target), known, [3, 10, 0], [5, 0, 2])
            reader.start_load(KVLoad(kv_cache_dtype, source, [3, 10, 0], [5, 0, 2]), target)
            assert wait_for(reader, 1) == [KVLoadResult(kv_cache_dtype, 3)]
            assert_bytes(target, expected)

        # The exporting engine dies: its readers learn it from NIXL within seconds.
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(10)
        started = time.monotonic()
        readers["fresh"] = make_transport(exporting=False)  # meets the source only after it died
        targets["fresh"] = make_caches("auto")
        for kv_cache_dtype, source in [*sources.items(), ("fresh", sources["auto"])]:
            load = KVLoad("late", source, [1, 2], [1, 2])
            readers[kv_cache_dtype].start_load(load, targets[kv_cache_dtype])
        for reader in readers.values():
            [result] = wait_for(reader, 1, seconds=5)
            assert result.request_id == "late" and result.num_blocks_loaded == 0 and result.error
            assert reader.poll() == []
        print(f"dead source reported in {time.monotonic() - started:.3f} s: {result.error}")
    finally:
        child.kill()
        child.join()


def test_engines_over_nixl_match_colocated(nixl_works: None, tiny_model_dir: Callable[[str], str]) -> None:
    from tests.engine.test_disaggregation import collect, engine, run, workload

    model = tiny_model_dir("llama")
    requests = workload(count=12)
    colocated = engine(model, num_gpu_blocks=200)
    for request in requests:
        colocated.add_request(request)
    expected: tuple[dict, dict] = ({}, {})
    while colocated.has_unfinished_requests():
        collect(colocated.step, *expected)

    prefill = engine(model, "prefill", kv_transport="nixl", num_gpu_blocks=200)
    decode = engine(model, "decode", kv_transport="nixl", num_gpu_blocks=200)
    assert (
        decode.runner.kv_connector is not None
        and isinstance(decode.runner.kv_connector.transport, NixlTransport)
        and prefill.kv_source is not None
    )
    cluster = LocalCluster([prefill], [decode])
    try:
        assert run(cluster, workload(count=12)) == expected
        assert cluster.coordinator.stats.num_remote_prefills >= 6, "most prompts must go through a transfer"
    finally:
        for core in (prefill, decode):
            core.close()
