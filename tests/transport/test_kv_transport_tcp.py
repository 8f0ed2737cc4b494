"""The TCP KV transport (ZMQ): an exporter's server thread, a reader's I/O thread.

A load must copy exactly the blocks it names (every other byte of the reader's cache
stays as it was), refuse a source laid out otherwise, a reply of the wrong size and a
cancelled load's late reply without writing anything, report every load once, and turn
a source that closed, died or never answers into an error result within seconds, never
an exception or a hang. `close` returns at once and leaves no thread behind. Contents
are random bytes compared as bytes.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.queues import Queue
from typing import Any

import numpy as np
import pytest
import zmq

from cadence.engine.kv_transfer import tcp
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.kv_transfer.tcp import TcpTransport
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult
from tests.support.kv_transport_checks import (
    NUM_LAYERS,
    assert_bytes,
    expect_copied,
    fill,
    layout,
    make_caches,
    snapshot,
    wait_for,
)


@pytest.fixture
def make_transport() -> Iterator[Callable[..., TcpTransport]]:
    made: list[TcpTransport] = []

    def make(exporting: bool = True, kind: type[TcpTransport] = TcpTransport) -> TcpTransport:
        made.append(kind(exporting))
        return made[-1]

    yield make
    for transport in made:
        transport.close()


def at(source: KVSource, endpoint: str) -> KVSource:
    """The source, its address moved to `endpoint`."""
    return KVSource(source.transport, json.dumps({**json.loads(source.address), "endpoint": endpoint}), source.layout)


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_a_load_copies_exactly_the_named_blocks(
    make_transport: Callable[..., TcpTransport], kv_cache_dtype: str
) -> None:
    exporter, reader = make_transport(), make_transport(exporting=False)
    source_caches = make_caches(kv_cache_dtype)
    target = make_caches(kv_cache_dtype, num_blocks=10)  # block counts may differ
    fill(source_caches, seed=1)
    fill(target, seed=2)
    source = exporter.export(source_caches, layout(kv_cache_dtype))
    assert isinstance(source.address, str) and source.transport == "tcp"
    assert json.loads(source.address)["endpoint"].startswith("tcp://127.0.0.1:")

    remote, local = [7, 2, 3, 11, 0], [0, 5, 6, 9, 8]
    expected = expect_copied(snapshot(target), source_caches, remote, local)
    reader.start_load(KVLoad("a", source, remote, local), target)
    assert wait_for(reader, 1) == [KVLoadResult("a", 5)]
    assert_bytes(target, expected)

    # The same source again (its socket kept): what the exporter wrote since is read.
    fill(source_caches, seed=3)
    expected = expect_copied(snapshot(target), source_caches, [4, 5], [1, 2])
    reader.start_load(KVLoad("b", source, [4, 5], [1, 2]), target)
    assert wait_for(reader, 1) == [KVLoadResult("b", 2)]
    reader.cancel("b")  # over already: a no-op
    reader.start_load(KVLoad("empty", source, [], []), target)
    assert wait_for(reader, 1) == [KVLoadResult("empty", 0)]
    time.sleep(0.05)
    assert reader.poll() == []
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
    make_transport: Callable[..., TcpTransport],
    kv_cache_dtype: str,
    options: dict[str, int],
    load: tuple[list[int], list[int]],
) -> None:
    exporter, reader = make_transport(), make_transport(exporting=False)
    source_caches = make_caches("auto")
    fill(source_caches, seed=1)
    source = exporter.export(source_caches, layout("auto"))
    target = make_caches(kv_cache_dtype, **options)
    fill(target, seed=2)
    before = snapshot(target)
    reader.start_load(KVLoad("r", source, *load), target)
    [result] = wait_for(reader, 1)
    assert result.request_id == "r" and result.num_blocks_loaded == 0 and result.error
    assert_bytes(target, before)


def test_foreign_sources_and_unreachable_hosts_are_refused(make_transport: Callable[..., TcpTransport]) -> None:
    reader = make_transport(exporting=False)
    target = make_caches("auto")
    with pytest.raises(ValueError, match="reading only"):
        reader.export(target, layout("auto"))
    for host in ("0.0.0.0", "*"):
        with pytest.raises(ValueError, match="every interface"):
            TcpTransport(host=host).export(target, layout("auto"))
    for source in [KVSource("shared-memory", "{}", layout("auto")), KVSource("tcp", "{", layout("auto")), "x"]:
        reader.start_load(KVLoad("r", source, [0], [0]), target)
    results = wait_for(reader, 3)
    assert [r.num_blocks_loaded for r in results] == [0] * 3 and all(r.error for r in results)

    # An endpoint zmq cannot parse fails in the I/O thread, which goes on reading other sources.
    exporter = make_transport()
    source_caches = make_caches("auto")
    fill(source_caches, seed=1)
    source = exporter.export(source_caches, layout("auto"))
    reader.start_load(KVLoad("bad", at(source, "not an endpoint"), [0], [0]), target)
    [result] = wait_for(reader, 1)
    assert result.num_blocks_loaded == 0 and "cannot send" in str(result.error)
    expected = expect_copied(snapshot(target), source_caches, [3], [4])
    reader.start_load(KVLoad("good", source, [3], [4]), target)
    assert wait_for(reader, 1) == [KVLoadResult("good", 1)]
    assert_bytes(target, expected)


def test_the_exporter_answers_bad_reads_with_errors_and_keeps_serving(
    make_transport: Callable[..., TcpTransport],
) -> None:
    exporter = make_transport()
    source_caches = make_caches("auto")
    fill(source_caches, seed=1)
    address = json.loads(exporter.export(source_caches, layout("auto")).address)
    token, ids = address["token"].encode(), np.array([3], dtype="<i8").tobytes()
    context = zmq.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.connect(address["endpoint"])
    try:
        for request in [
            [b"1", b"another export", ids],
            [b"2", token, np.array([12], dtype="<i8").tobytes()],
            [b"3", token, np.array([-1], dtype="<i8").tobytes()],
            [b"4", token, b"odd"],
            [b"5", token],
        ]:
            dealer.send_multipart(request)
            assert dealer.poll(5000), "the server thread must answer, not die"
            seq, status, *data = dealer.recv_multipart()
            assert seq == request[0] and status.startswith(b"error") and not data
        dealer.send_multipart([b"6", token, ids])
        assert dealer.poll(5000)
        seq, status, *data = dealer.recv_multipart()
        assert status == b"ok" and len(data) == NUM_LAYERS
        assert data[0] == source_caches[0][:, 3].numpy().tobytes()  # type: ignore[index]
    finally:
        dealer.close(linger=0)
        context.term()


class HeldExporter(TcpTransport):
    """An exporter whose server thread, once asked, waits to be let go before replying."""

    def __init__(self, exporting: bool = True) -> None:
        super().__init__(exporting)
        self.asked, self.go = threading.Event(), threading.Event()

    def _reply_buffers(self, ids: np.ndarray) -> list[np.ndarray]:
        self.asked.set()
        self.go.wait(10)
        return super()._reply_buffers(ids)


def test_a_cancelled_load_is_reported_once_and_its_late_reply_dropped(
    make_transport: Callable[..., Any],
) -> None:
    exporter, reader = make_transport(kind=HeldExporter), make_transport(exporting=False)
    source_caches = make_caches("auto")
    fill(source_caches, seed=1)
    source = exporter.export(source_caches, layout("auto"))
    target = make_caches("auto")
    fill(target, seed=2)
    before = snapshot(target)
    reader.start_load(KVLoad("c", source, [0, 1, 2], [3, 4, 5]), target)
    assert exporter.asked.wait(5)
    reader.cancel("c")
    reader.cancel("unknown")  # no load of that name: nothing happens
    assert reader.poll() == [KVLoadResult("c", 0, "cancelled")]
    exporter.go.set()
    # One socket per source, served in order: once this load is in, so was the reply to "c".
    expected = expect_copied(before, source_caches, [6], [7])
    reader.start_load(KVLoad("d", source, [6], [7]), target)
    assert wait_for(reader, 1) == [KVLoadResult("d", 1)]
    assert_bytes(target, expected)


class BadReplies(TcpTransport):
    """An exporter whose replies carry the wrong number of bytes."""

    mode = "truncated"

    def _reply_buffers(self, ids: np.ndarray) -> list[np.ndarray]:
        buffers = super()._reply_buffers(ids)
        if self.mode == "truncated":
            buffers[-1] = buffers[-1].reshape(-1)[:-1]
        elif self.mode == "oversized":
            buffers[0] = np.concatenate([buffers[0].reshape(-1), np.zeros(1, dtype=np.uint8)])
        else:
            buffers.pop()
        return buffers


@pytest.mark.parametrize("mode", ["truncated", "oversized", "a tensor short"])
def test_a_reply_of_the_wrong_size_writes_nothing(
    make_transport: Callable[..., TcpTransport], monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    monkeypatch.setattr(BadReplies, "mode", mode)
    exporter, reader = make_transport(kind=BadReplies), make_transport(exporting=False)
    source_caches = make_caches("int8")
    fill(source_caches, seed=1)
    source = exporter.export(source_caches, layout("int8"))
    target = make_caches("int8")
    fill(target, seed=2)
    before = snapshot(target)
    reader.start_load(KVLoad("t", source, [0, 1], [2, 3]), target)
    [result] = wait_for(reader, 1)
    assert result.num_blocks_loaded == 0 and "bytes per KV tensor" in str(result.error)
    assert_bytes(target, before)


def test_a_source_that_never_answers_fails_at_the_deadline(
    make_transport: Callable[..., TcpTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tcp, "_TIMEOUT_S", 0.3)
    exporter, reader = make_transport(), make_transport(exporting=False)
    source = exporter.export(make_caches("auto"), layout("auto"))
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes reads, answers none
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    target = make_caches("auto")
    before = snapshot(target)
    try:
        started = time.monotonic()
        reader.start_load(KVLoad("s", at(source, f"tcp://127.0.0.1:{port}"), [1], [1]), target)
        [result] = wait_for(reader, 1, seconds=30)
        assert result.num_blocks_loaded == 0 and "deadline" in str(result.error)
        assert time.monotonic() - started >= 0.3, "failed before its deadline"
        assert silent.poll(1000), "the read was sent"
    finally:
        silent.close(linger=0)
        context.term()
    assert_bytes(target, before)


def native_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_close_is_prompt_and_leaves_no_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    # Load "b" below never gets an answer: with no deadline in sight, only close can end it.
    monkeypatch.setattr(tcp, "_TIMEOUT_S", 3600.0)
    make_caches("auto")  # whatever torch starts on first use is not ours
    threads, native = set(threading.enumerate()), native_threads()
    exporter, reader = TcpTransport(), TcpTransport(exporting=False)
    source_caches = make_caches("auto")
    source = exporter.export(source_caches, layout("auto"))
    target = make_caches("auto")
    reader.start_load(KVLoad("a", source, [1], [1]), target)
    assert wait_for(reader, 1) == [KVLoadResult("a", 1)]
    silent = TcpTransport()
    silent_source = silent.export(make_caches("auto"), layout("auto"))
    silent.close()
    reader.start_load(KVLoad("b", at(source, json.loads(silent_source.address)["endpoint"]), [1], [1]), target)
    exporter.close()
    reader.close()
    reader.close()  # twice is once
    # Prompt: close returned because its threads ended, not because its joins gave up on them.
    assert set(threading.enumerate()) <= threads, "close left its threads running"
    assert [r.request_id for r in reader.poll()] in ([], ["b"])  # failed, or ended by close
    reader.start_load(KVLoad("late", source, [1], [1]), target)
    [result] = reader.poll()
    assert result.num_blocks_loaded == 0 and "closed" in str(result.error)
    # zmq's own threads end a moment after its context; threads of earlier tests may end too.
    deadline = time.monotonic() + 2
    while not native_threads() <= native and time.monotonic() < deadline:
        time.sleep(0.01)
    assert set(threading.enumerate()) <= threads and native_threads() <= native


def export_in_child(sources: Queue) -> None:
    """A prefill engine's half in another process: known contents in a plain and a
    quantized cache, exported, held until killed."""
    held = []
    for kv_cache_dtype in ("auto", "int8"):
        transport, caches = TcpTransport(), make_caches(kv_cache_dtype)
        fill(caches, seed=7)
        sources.put((kv_cache_dtype, transport.export(caches, layout(kv_cache_dtype))))
        held.append((transport, caches))
    time.sleep(60)


def test_loads_across_processes_and_from_a_killed_source(
    make_transport: Callable[..., TcpTransport], monkeypatch: pytest.MonkeyPatch
) -> None:
    # One child for both cache kinds: a spawned child spends seconds importing torch.
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=export_in_child, args=(queue,), daemon=True)
    child.start()
    try:
        sources: dict[str, KVSource] = dict(queue.get(timeout=60) for _ in range(2))
        readers, targets = {}, {}
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

        # The exporting engine dies: its readers see the connection go, not a deadline (an
        # hour away from here on, so that only the socket can end these loads in time).
        os.kill(child.pid or 0, signal.SIGKILL)
        child.join(10)
        monkeypatch.setattr(tcp, "_TIMEOUT_S", 3600.0)
        readers["fresh"] = make_transport(exporting=False)  # meets the source only after it died
        targets["fresh"] = make_caches("auto")
        for kv_cache_dtype, source in [*sources.items(), ("fresh", sources["auto"])]:
            before = snapshot(targets[kv_cache_dtype])
            readers[kv_cache_dtype].start_load(KVLoad("late", source, [1, 2], [1, 2]), targets[kv_cache_dtype])
            [result] = wait_for(readers[kv_cache_dtype], 1, seconds=30)
            assert result.request_id == "late" and result.num_blocks_loaded == 0 and result.error
            assert "deadline" not in result.error, "a dead source is seen by its socket, before any deadline"
            assert_bytes(targets[kv_cache_dtype], before)
    finally:
        child.kill()
        child.join()


def test_engines_over_tcp_match_colocated(tiny_model_dir: Callable[[str], str]) -> None:
    from cadence.server.disaggregation.local_cluster import LocalCluster
    from tests.engine.test_disaggregation import collect, engine, run, workload

    model = tiny_model_dir("llama")
    colocated = engine(model, num_gpu_blocks=200)
    for request in workload(count=12):
        colocated.add_request(request)
    expected: tuple[dict, dict] = ({}, {})
    while colocated.has_unfinished_requests():
        collect(colocated.step, *expected)

    prefill = engine(model, "prefill", kv_transport="tcp", num_gpu_blocks=200)
    decode = engine(model, "decode", kv_transport="tcp", num_gpu_blocks=200)
    assert (
        decode.runner.kv_connector is not None
        and isinstance(decode.runner.kv_connector.transport, TcpTransport)
        and prefill.kv_source is not None
    )
    cluster = LocalCluster([prefill], [decode])
    try:
        assert run(cluster, workload(count=12)) == expected
        assert cluster.coordinator.stats.num_remote_prefills >= 6, "most prompts must go through a transfer"
    finally:
        for core in (prefill, decode):
            core.close()
