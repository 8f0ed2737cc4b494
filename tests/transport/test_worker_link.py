"""The router-worker link (server/disaggregation/worker_link.py and remote_engine.py) over
loopback TCP.

The worker's engine is a recorder of what reaches it, and routers are `RemoteEngine`s (or
raw sockets, for misbehaving ones). What must hold: a router sees only its own
requests' outputs and events and can steer only its own requests; a session that ends
by goodbye, by silence or by the engine's death aborts exactly the requests it started
and has not finished; a message from an unknown session never reaches the engine; and a
worker that goes away is noticed by its routers at once, not after the timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
import zmq
import zmq.asyncio

from cadence.engine.protocol import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    EngineStats,
    LinkHello,
    LoadKV,
    Message,
    ReleaseKV,
    decode,
    encode,
)
from cadence.engine.sampling_params import SamplingParams
from cadence.scheduler.remote_kv import KVPrefilled, KVReservation
from cadence.server.disaggregation import remote_engine
from cadence.server.disaggregation.remote_engine import RemoteEngine
from cadence.server.disaggregation.topology import LinkTiming
from cadence.server.disaggregation.worker_link import WorkerLink
from cadence.server.engine_events import DrainingChanged, EngineDied, EngineEvent, EngineServing, OutputsArrived
from cadence.server.engine_handle import EngineHandle
from cadence.server.engine_process import EngineDeadError

FAST = LinkTiming(heartbeat=0.05, timeout=0.6)
PATIENT = LinkTiming(heartbeat=0.05, timeout=30.0)  # so that silence cannot be what ends a session
READY = EngineReady(64, 100, 4, "cpu", "float32", 10, kv_role="decode")


@dataclass
class Listener:
    """A router's engine client, reduced to what it hears: its event queue's consumer."""

    outputs: list[EngineCoreOutputs] = field(default_factory=list)
    dead: list[str] = field(default_factory=list)
    ready: int = 0
    draining: list[bool] = field(default_factory=list)

    def __call__(self, event: EngineEvent) -> None:
        if isinstance(event, OutputsArrived):
            self.on_outputs(event.engine, event.message)
        elif isinstance(event, EngineDied):
            self.dead.append(event.reason)
        elif isinstance(event, EngineServing):
            self.ready += 1
        elif isinstance(event, DrainingChanged):
            self.draining.append(event.draining)
        else:
            raise AssertionError(f"a remote engine never reports {event}")

    def on_outputs(self, engine: EngineHandle, message: EngineCoreOutputs) -> None:
        self.outputs.append(message)

    def request_ids(self) -> list[str]:
        return [o.request_id for message in self.outputs for o in message.outputs]


def request(request_id: str, n: int = 1) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [1, 2, 3], SamplingParams(max_tokens=4, n=n), remote_kv="load")


def output(request_id: str, finished: bool = False, index: int = 0) -> EngineCoreOutput:
    return EngineCoreOutput(request_id, index, [7], finish_reason="length" if finished else None)


async def eventually(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("timed out waiting")
        await asyncio.sleep(0.01)


def run(
    scenario: Callable[[zmq.asyncio.Context, WorkerLink, list[Message]], Awaitable[None]],
    monkeypatch: pytest.MonkeyPatch,
    timing: LinkTiming = FAST,
) -> None:
    """Run a scenario against a worker link whose engine records what reaches it."""

    async def main() -> None:
        context = zmq.asyncio.Context()
        engine: list[Message] = []
        link = WorkerLink(context, "tcp://127.0.0.1:0", engine.append, timing)
        link.on_engine_ready(READY)
        link.start()
        info = {"role": "decode", "link_port": link.port}
        monkeypatch.setattr(remote_engine, "fetch_worker_info", lambda url, timeout: info)
        try:
            await scenario(context, link, engine)
        finally:
            await link.close()
            context.destroy(linger=0)

    asyncio.run(main())


async def connected(context: zmq.asyncio.Context, listener: Listener, timing: LinkTiming = FAST) -> RemoteEngine:
    remote = RemoteEngine("http://127.0.0.1:1", "decode", context, listener, timing)
    remote.spawn()
    assert await remote.wait_ready(5.0) == READY
    return remote


def test_each_router_hears_and_steers_only_its_own_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        first, second = Listener(), Listener()
        a, b = await connected(context, first), await connected(context, second)
        a.send(request("a1"))
        b.send(request("b1"))
        a.send(request("a2"))
        await eventually(lambda: len(engine) == 3)
        stats = EngineStats(num_running=2)
        link.on_outputs(
            EngineCoreOutputs(
                [output("a1"), output("b1"), output("local")],
                stats,
                rejected={"b1": "too long", "local": "x"},
                kv_reserved=[KVReservation("a1", 0, 3)],
                kv_prefilled=[KVPrefilled("b1", [1], 2)],
            )
        )
        await eventually(lambda: bool(first.outputs and second.outputs))
        assert first.request_ids() == ["a1"] and second.request_ids() == ["b1"]
        assert [r.request_id for r in first.outputs[0].kv_reserved] == ["a1"] and not first.outputs[0].rejected
        assert second.outputs[0].rejected == {"b1": "too long"} and not second.outputs[0].kv_reserved
        assert [p.request_id for p in second.outputs[0].kv_prefilled] == ["b1"]
        assert a.stats == stats
        b.send(AbortRequests(["a1"]))  # not b's to abort
        b.send(LoadKV("a1", None, [0]))  # type: ignore[arg-type]
        a.send(ReleaseKV(["a2"]))  # a's own: passed on
        await eventually(lambda: len(engine) == 4)
        await asyncio.sleep(0.1)
        assert engine[3:] == [ReleaseKV(["a2"])]
        b.send(request("a1"))  # an id another session uses is refused to its sender only
        await eventually(lambda: any("a1" in m.rejected for m in second.outputs))
        assert len(engine) == 4 and not any("a1" in m.rejected for m in first.outputs)
        await a.shutdown(1.0)
        await b.shutdown(1.0)

    run(scenario, monkeypatch)


def test_goodbye_aborts_the_unfinished_requests_of_that_session_only(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        mine, other = Listener(), Listener()
        a, b = await connected(context, mine, PATIENT), await connected(context, other, PATIENT)
        for request_id in ("done", "pair", "open", "held", "stopped"):
            a.send(request(request_id, n=2 if request_id == "pair" else 1))
        b.send(request("theirs"))
        await eventually(lambda: len(engine) == 6)
        link.on_outputs(
            EngineCoreOutputs(
                [output("done", True), output("pair", True, index=1)],
                EngineStats(),
                kv_prefilled=[KVPrefilled("held", [4], 2)],
            )
        )
        await eventually(lambda: len(mine.outputs) == 1 and len(other.outputs) == 1)  # the gauges reach both
        b.send(AbortRequests(sequences=[("stopped", 0)]))  # not b's
        a.send(AbortRequests(sequences=[("stopped", 0)]))  # a stop string ended it
        await eventually(lambda: len(engine) == 7)
        await a.shutdown(1.0)
        await eventually(lambda: len(engine) == 8)
        # "pair" has a sequence left; "held" KV may be being read: its hold deadline frees it.
        assert engine[6:] == [AbortRequests(sequences=[["stopped", 0]]), AbortRequests(["pair", "open"])]  # type: ignore[list-item]
        assert len(link.sessions) == 1
        await b.shutdown(1.0)

    run(scenario, monkeypatch, PATIENT)


def test_a_router_whose_connection_drops_is_dropped_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        raw = context.socket(zmq.DEALER)
        raw.connect(link.address)
        await raw.send_multipart([b"two", b"frames"])  # not a message: dropped, the link goes on
        await raw.send(encode(LinkHello("gone")))
        assert isinstance(decode(await raw.recv()), EngineReady)
        await raw.send(encode(request("g1")))
        await eventually(lambda: len(engine) == 1)
        raw.close(linger=0)
        await eventually(lambda: len(engine) == 2, timeout=5.0)  # the timeout is 30 s
        assert engine[1] == AbortRequests(["g1"]) and not link.sessions

    run(scenario, monkeypatch, PATIENT)


def test_a_draining_worker_is_told_apart_and_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        listener = Listener()
        remote = await connected(context, listener)
        remote.send(request("last"))
        await eventually(lambda: len(engine) == 1)
        drained = asyncio.create_task(link.drain(5.0))
        await eventually(lambda: listener.draining == [True])
        late = context.socket(zmq.DEALER)
        late.connect(link.address)
        await late.send(encode(LinkHello("late")))
        answer = decode(await late.recv())
        assert isinstance(answer, EngineDead) and "shutting down" in answer.message
        await asyncio.sleep(0.2)
        assert not drained.done()  # "last" is still running
        link.on_outputs(EngineCoreOutputs([output("last", True)], EngineStats()))
        await asyncio.wait_for(drained, 2.0)
        assert listener.request_ids() == ["last"] and remote.is_healthy
        late.close(linger=0)
        await remote.shutdown(1.0)

    run(scenario, monkeypatch)


def test_a_router_failing_on_outputs_ends_the_session_instead_of_hanging_it(monkeypatch: pytest.MonkeyPatch) -> None:
    class Broken(Listener):
        def on_outputs(self, engine: EngineHandle, message: EngineCoreOutputs) -> None:
            engine.fail(f"processing its events failed: {RuntimeError('a bug in the router')!r}")

    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        listener = Broken()
        remote = await connected(context, listener)
        link.on_outputs(EngineCoreOutputs([], EngineStats()))
        await eventually(lambda: bool(listener.dead))
        assert "a bug in the router" in listener.dead[0]
        await eventually(lambda: listener.ready == 2)  # a new session
        await remote.shutdown(1.0)

    run(scenario, monkeypatch)


def test_a_silent_router_is_dropped_and_its_requests_aborted(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        raw = context.socket(zmq.DEALER)
        raw.connect(link.address)
        # Before the hello: the link can have heard from this router no earlier than this.
        started = asyncio.get_running_loop().time()
        await raw.send(encode(LinkHello("quiet")))
        assert isinstance(decode(await raw.recv()), EngineReady)
        await raw.send(encode(request("q1")))
        await eventually(lambda: len(engine) == 1)
        await eventually(lambda: len(engine) == 2, timeout=30.0)
        assert asyncio.get_running_loop().time() - started >= FAST.timeout, "dropped before a timeout of silence"
        assert engine[1] == AbortRequests(["q1"]) and not link.sessions
        raw.close(linger=0)

    run(scenario, monkeypatch)


def test_messages_of_unknown_sessions_never_reach_the_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        raw = context.socket(zmq.DEALER)
        raw.connect(link.address)
        await raw.send(b"\xc1 not msgpack")
        await raw.send(encode(request("stale")))
        answer = decode(await raw.recv())
        assert isinstance(answer, EngineDead) and "no such session" in answer.message
        await raw.send(encode(LinkHello("late")))
        assert isinstance(decode(await raw.recv()), EngineReady)
        await raw.send(encode(EngineReady(1, 1, 1, "cpu", "float32", 1)))  # not a router's to send
        await raw.send(encode(request("fresh")))
        await eventually(lambda: len(engine) == 1)
        assert [m.request_id for m in engine] == ["fresh"]  # type: ignore[union-attr]
        raw.close(linger=0)

    run(scenario, monkeypatch)


def test_engine_death_ends_sessions_and_a_new_engine_is_taken_up(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        listener = Listener()
        remote = await connected(context, listener)
        remote.send(request("r1"))
        await eventually(lambda: len(engine) == 1)
        link.on_engine_dead("the engine process exited unexpectedly")
        await eventually(lambda: bool(listener.dead))
        assert "exited unexpectedly" in listener.dead[0] and not remote.is_healthy
        with pytest.raises(EngineDeadError):
            remote.send(request("r2"))
        link.on_outputs(EngineCoreOutputs([output("r1")], EngineStats()))  # the dead engine's last words
        link.on_engine_ready(READY)
        await eventually(lambda: listener.ready == 2)
        assert remote.is_healthy and listener.request_ids() == []
        assert engine == [request("r1")]  # nothing aborted: the engine that ran r1 is gone
        await remote.shutdown(1.0)

    run(scenario, monkeypatch)


def test_a_worker_that_goes_away_is_noticed_before_the_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        listener = Listener()
        remote = RemoteEngine("http://127.0.0.1:1", "decode", context, listener, PATIENT)
        remote.spawn()
        await remote.wait_ready(5.0)
        await link.close()
        # Noticed as a closed link: silence could end the session only after PATIENT's 30 s.
        await eventually(lambda: bool(listener.dead), timeout=PATIENT.timeout)
        assert "closed its link" in listener.dead[0]
        await remote.shutdown(1.0)

    run(scenario, monkeypatch)


def test_a_worker_of_the_wrong_role_is_never_admitted(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(context: zmq.asyncio.Context, link: WorkerLink, engine: list[Message]) -> None:
        listener = Listener()
        remote = RemoteEngine("http://127.0.0.1:1", "prefill", context, listener, FAST)
        remote.spawn()
        await asyncio.sleep(0.5)
        assert listener.ready == 0 and not link.sessions
        assert "decode worker, listed as prefill" in remote.unavailable_reason
        await remote.shutdown(1.0)

    run(scenario, monkeypatch)
