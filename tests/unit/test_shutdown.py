"""The pieces of a shutdown, without a model: the deadline, what a stream sends when its
request is ended there, SIGHUP as SIGTERM, and an engine process dying with its parent.
test_server_shutdown.py runs them together against real servers."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import uvicorn

from cadence.engine.output_processor import OutputProcessor
from cadence.engine.protocol import EngineCoreRequest
from cadence.engine.sampling_params import SamplingParams
from cadence.server.draining_server import DrainingServer
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.errors import APIError, unavailable
from cadence.server.request_stream import RequestStream
from cadence.server.serving import RequestGroup, stream_events
from cadence.server.shutdown_deadline import CancelledAfterDeadline, ShutdownDeadline
from tests.support.server_harness import pid_alive


# ----- the deadline -------------------------------------------------------------------------
def test_the_deadline_ends_requests_once_it_passes_and_not_when_cancelled() -> None:
    async def run(cancel: bool) -> list[str]:
        deadline = ShutdownDeadline(0.01)
        called: list[str] = []
        deadline.on_expiry(lambda: called.append("ended"))
        deadline.start()
        deadline.start()  # a second start keeps the first count
        if cancel:
            deadline.cancel()
        await asyncio.sleep(0.2)
        assert deadline.passed == (not cancel)
        return called

    assert asyncio.run(run(cancel=False)) == ["ended"]
    assert asyncio.run(run(cancel=True)) == []


def test_uvicorn_cancels_only_after_the_final_events_had_time() -> None:
    assert ShutdownDeadline(30.0).server_timeout > 30.0


def _cancelled_app(deadline: ShutdownDeadline) -> Callable[[], None]:
    async def cancelled(scope: object, receive: object, send: object) -> None:
        raise asyncio.CancelledError

    guard = CancelledAfterDeadline(cancelled, deadline)
    return lambda: asyncio.run(guard({"type": "http", "path": "/v1/completions"}, None, None))  # type: ignore[arg-type]


def test_a_cancellation_before_the_deadline_goes_on_up() -> None:
    with pytest.raises(asyncio.CancelledError):
        _cancelled_app(ShutdownDeadline(30.0))()


def test_a_cancellation_after_the_deadline_ends_quietly(caplog: pytest.LogCaptureFixture) -> None:
    deadline = ShutdownDeadline(0.0)
    deadline.passed = True
    _cancelled_app(deadline)()
    assert "Traceback" not in caplog.text
    assert "cut off at shutdown" in caplog.text


# ----- what a client sees ---------------------------------------------------------------------
class _Client:
    """Stands in for AsyncEngineClient: the ended request is already out of the engine."""

    def abort(self, request_id: str) -> None:
        pass


def test_a_stream_ended_at_the_deadline_gets_an_error_event_then_done() -> None:
    async def run() -> list[str]:
        processor = OutputProcessor(tokenizer=None)
        processor.add_request("r", None, [5, 6], SamplingParams(max_tokens=100))
        group = RequestGroup(_Client(), priority=0)  # type: ignore[arg-type]
        stream = RequestStream(processor.states["r"].output, processor, group._changed, _Client().abort)
        group.streams.append(stream)
        events = stream_events(group, list, list)
        waiting = asyncio.ensure_future(events.__anext__())
        await asyncio.sleep(0)
        stream.notify(unavailable("the server is shutting down"))  # as end_all_requests does
        return [await waiting] + [frame async for frame in events]

    error, done = asyncio.run(run())
    assert done == "data: [DONE]\n\n"
    body = json.loads(error.removeprefix("data: "))
    assert body["error"]["type"] == "service_unavailable"
    assert "shutting down" in body["error"]["message"]


def test_past_the_deadline_a_new_request_is_refused_the_same_way() -> None:
    client = AsyncEngineClient(max_waiting=1)
    client.end_all_requests(lambda: unavailable("the server is shutting down"))
    with pytest.raises(APIError) as refused:
        client.add_request(EngineCoreRequest("late-0", [5, 6], SamplingParams(max_tokens=4), 0), None)
    assert refused.value.status == 503
    assert refused.value.headers is not None and refused.value.headers["Retry-After"]


# ----- SIGHUP -----------------------------------------------------------------------------------
@pytest.fixture()
def sigterm_recorded() -> Iterator[list[int]]:
    """SIGTERM recorded instead of acted on: uvicorn raises it again after a drain."""
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, _: received.append(sig))
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _server() -> DrainingServer:
    deadline = ShutdownDeadline(1.0)
    config = uvicorn.Config("never:loaded", timeout_graceful_shutdown=deadline.server_timeout)
    return DrainingServer(config, deadline)


def test_sighup_drains_like_sigterm(sigterm_recorded: list[int]) -> None:
    server = _server()
    previous = signal.getsignal(signal.SIGHUP)
    with server.capture_signals():
        signal.raise_signal(signal.SIGHUP)
        assert server.should_exit and not server.force_exit
    assert sigterm_recorded == [signal.SIGTERM]  # uvicorn's exit after the drain, as for SIGTERM
    assert signal.getsignal(signal.SIGHUP) == previous


def test_sighup_stays_ignored_under_nohup(sigterm_recorded: list[int]) -> None:
    server = _server()
    previous = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with server.capture_signals():
            signal.raise_signal(signal.SIGHUP)
            assert not server.should_exit
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert sigterm_recorded == []


def test_the_server_starts_the_deadline_when_it_starts_shutting_down() -> None:
    server = _server()
    server.deadline = ShutdownDeadline(0.0)
    server.servers = []  # a bare server: nothing listens,
    server.force_exit = True  # and no lifespan is to be shut down
    asyncio.run(server.shutdown())
    assert server.deadline.passed


# ----- an engine process and its parent ----------------------------------------------------------
_FAMILY = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    from cadence.engine.parent_death import die_with_parent

    def child(go: str) -> None:
        while not os.path.exists(go):
            time.sleep(0.01)
        die_with_parent()
        print("armed", flush=True)
        time.sleep(120)

    if __name__ == "__main__":
        process = multiprocessing.get_context("spawn").Process(target=child, args=(sys.argv[1],), daemon=True)
        process.start()
        print(process.pid, flush=True)
        time.sleep(120)
    """
)


def _wait_gone(pid: int, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture()
def family(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """A parent process and its spawned child, which arms itself once `go` exists."""
    script = tmp_path / "family.py"
    script.write_text(_FAMILY)
    go = tmp_path / "go"
    parent = subprocess.Popen([sys.executable, str(script), str(go)], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        yield parent, child, go
    finally:
        parent.kill()
        parent.wait()
        if pid_alive(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_killed_parent_even_when_stopped(family: tuple[subprocess.Popen[str], int, Path]) -> None:
    parent, child, go = family
    go.touch()
    assert parent.stdout is not None
    assert parent.stdout.readline().strip() == "armed"
    # Stopped, it could never look at its parent itself: only the kernel can end it.
    os.kill(child, signal.SIGSTOP)
    parent.kill()
    _wait_gone(child, "the child outlived its parent")


def test_a_child_whose_parent_died_before_it_armed_exits(family: tuple[subprocess.Popen[str], int, Path]) -> None:
    parent, child, go = family
    parent.kill()
    parent.wait()
    go.touch()
    _wait_gone(child, "the child went on without its parent")
