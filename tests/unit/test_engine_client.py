"""The engine client's parts put together, over a fake engine that records what it is sent:
events flow from the engine through the queue to the request streams, and nothing flows
back but messages and `fail`."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from cadence.engine.engine_args import EngineArgs
from cadence.engine.protocol import (
    AbortRequests,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStats,
    Message,
)
from cadence.engine.sampling_params import SamplingParams
from cadence.server import engine_supervisor
from cadence.server.admission import EngineOverloadedError
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.engine_events import EngineDied, EventSink, OutputsArrived
from cadence.server.engine_handle import EngineCounters
from cadence.server.engine_process import EngineDeadError

READY = EngineReady(64, 100, 2, "cpu", "float32", 10)


class FakeEngine:
    """A `LocalEngine` that starts nothing: ready at once, recording what it is sent."""

    def __init__(self, name: str, args: EngineArgs, *rest: object) -> None:
        self.name = name
        self.role = "colocated"
        self.events: EventSink = rest[3]  # type: ignore[assignment]
        self.info: EngineReady | None = None
        self.stats = EngineStats()
        self.counters = EngineCounters()
        self.dead_reason: str | None = None
        self.draining = False
        self.sent: list[Message] = []
        self.failures: list[str] = []

    is_healthy = property(lambda self: self.dead_reason is None)
    is_restarting = property(lambda self: False)
    retry_after = property(lambda self: 1)
    unavailable_reason = property(lambda self: self.dead_reason or "")

    def spawn(self) -> None:
        pass

    async def wait_ready(self, timeout: float) -> EngineReady:
        self.info = READY
        return READY

    async def shutdown(self, timeout: float) -> None:
        pass

    def send(self, message: Message) -> None:
        self.sent.append(message)

    def fail(self, reason: str) -> None:
        self.failures.append(reason)


def run(scenario: Callable[[AsyncEngineClient, FakeEngine], Awaitable[None]], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine_supervisor, "LocalEngine", FakeEngine)
    monkeypatch.setattr(engine_supervisor, "remove_dead_socket_folders", lambda: None)

    async def main() -> None:
        client = AsyncEngineClient(max_waiting=1)
        client.spawn(EngineArgs(model="fake"))
        await client.wait_ready(1.0, tokenizer=None)
        (engine,) = client.engines.values()
        assert isinstance(engine, FakeEngine)
        try:
            await scenario(client, engine)
        finally:
            await client.shutdown(1.0)

    asyncio.run(main())


def request(request_id: str, n: int = 1) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, [5, 6], SamplingParams(max_tokens=4, n=n))


def step(*outputs: EngineCoreOutput) -> EngineCoreOutputs:
    return EngineCoreOutputs(list(outputs), EngineStats())


def test_outputs_reach_the_stream_through_the_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(client: AsyncEngineClient, engine: FakeEngine) -> None:
        stream = client.add_request(request("r"), None)
        assert engine.sent == [request("r")]
        engine.events(OutputsArrived(engine, step(EngineCoreOutput("r", 0, [7]))))
        assert stream.output.outputs[0].token_ids == []  # nothing is handled inline
        await asyncio.wait_for(stream.changed.wait(), 1.0)
        assert stream.output.outputs[0].token_ids == [7] and not stream.output.finished
        stream.changed.clear()
        engine.events(OutputsArrived(engine, step(EngineCoreOutput("r", 0, [8], finish_reason="length"))))
        await asyncio.wait_for(stream.changed.wait(), 1.0)
        assert stream.output.finished and client.fanout.num_sequences == 0

    run(scenario, monkeypatch)


def test_a_stream_aborts_through_its_callback_and_frees_its_seats(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(client: AsyncEngineClient, engine: FakeEngine) -> None:
        stream = client.add_request(request("r", n=2), None)
        with pytest.raises(EngineOverloadedError):  # 2 running and 1 waiting seats, 2 taken
            client.add_request(request("s", n=2), None)
        stream.abort()
        assert engine.sent[-1] == AbortRequests(request_ids=["r"])
        assert client.fanout.num_sequences == 0
        client.add_request(request("s", n=2), None)

    run(scenario, monkeypatch)


def test_a_dead_engine_fails_its_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    async def scenario(client: AsyncEngineClient, engine: FakeEngine) -> None:
        stream = client.add_request(request("r"), None)
        engine.dead_reason = "the engine process exited unexpectedly"
        engine.events(EngineDied(engine, engine.dead_reason))
        await asyncio.wait_for(stream.changed.wait(), 1.0)
        with pytest.raises(EngineDeadError, match="exited unexpectedly"):
            stream.raise_if_failed()
        with pytest.raises(EngineDeadError):
            client.add_request(request("s"), None)

    run(scenario, monkeypatch)


def test_an_event_the_client_cannot_handle_fails_its_engine_and_the_next_ones_are_handled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def scenario(client: AsyncEngineClient, engine: FakeEngine) -> None:
        stream = client.add_request(request("r"), None)
        broken = EngineCoreOutputs(None, EngineStats())  # type: ignore[arg-type]
        engine.events(OutputsArrived(engine, broken))
        engine.events(OutputsArrived(engine, step(EngineCoreOutput("r", 0, [7]))))
        await asyncio.wait_for(stream.changed.wait(), 1.0)
        assert len(engine.failures) == 1 and "processing engine's events failed" in engine.failures[0]
        assert stream.output.outputs[0].token_ids == [7]

    run(scenario, monkeypatch)
