"""How `cadence serve` ends, as its clients and its host see it.

SIGTERM, SIGHUP or SIGINT with long streams and a plain request running: at
`--shutdown-timeout` each stream ends with an error event saying the server is shutting
down, then [DONE]; the plain request gets 503 with Retry-After; nothing logs a traceback
and the server exits 0. The engine is stopped (SIGSTOP) before the signal, so every request is still
running at the deadline, whatever the machine's speed, and continued once the clients
have their answers so that it can stop cleanly.

SIGKILL of the API process alone, colocated or disaggregated: the engine processes go
with it, though stopped, so that only the kernel can end them (engine/parent_death.py).
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import httpx
import pytest

from cadence.engine.process_name import ENGINE, ROLE_NAMES
from tests.support.disaggregation_checks import FLAGS as DISAGGREGATED_FLAGS
from tests.support.server_checks import CHAT, CMPL, LONG, MESSAGES, MODEL, assert_error, assert_error_body, sse_data
from tests.support.server_harness import ServerProcess, pid_alive, wait_until

ADMITTED = "cadence:request_params_n_count"  # one per engine request the server has taken
# Streams of each kind the server ends: chat, chat with n=2, completions, and
# completions of two prompts (two engine requests behind one stream).
STREAMED: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"messages": MESSAGES}),
    (CHAT, {"messages": MESSAGES, "n": 2}),
    (CMPL, {"prompt": "The quick brown"}),
    (CMPL, {"prompt": ["The quick brown", "Once upon a time"]}),
]
STREAMED_ENGINE_REQUESTS = 5
LONG_REQUEST = {"model": MODEL, "max_tokens": LONG, "ignore_eos": True}


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


def signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        os.kill(pid, sig)


def assert_ended_by_shutdown(events: list[str]) -> None:
    """Ordinary chunks, none finished, then the error event and [DONE]."""
    assert events[-1] == "[DONE]", events[-3:]
    assert_error_body(json.loads(events[-2]), type="service_unavailable", code="service_unavailable")
    assert "shutting down" in json.loads(events[-2])["error"]["message"]
    for event in events[:-2]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        assert all(choice["finish_reason"] is None for choice in chunk["choices"]), chunk


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_requests_running_at_the_deadline_end_with_an_answer(model_dir: str, sig: int) -> None:
    server = ServerProcess(model_dir, "--served-model-name", MODEL, "--shutdown-timeout", "1")
    with server, ExitStack() as stack, ThreadPoolExecutor(1) as pool:
        engines = server.engine_pids(ENGINE)
        client = stack.enter_context(httpx.Client(timeout=60))
        streams: list[Iterator[str]] = []
        for path, body in STREAMED:
            response = stack.enter_context(
                client.stream("POST", f"{server.base_url}{path}", json={**LONG_REQUEST, **body, "stream": True})
            )
            assert response.status_code == 200, response.read()
            streams.append(sse_data(response.iter_lines()))
        firsts = [next(events) for events in streams]
        signal_all(engines, signal.SIGSTOP)  # from here on no request can finish
        for first in firsts:
            assert all(choice["finish_reason"] is None for choice in json.loads(first)["choices"]), first
        plain = pool.submit(httpx.post, f"{server.base_url}{CMPL}", json={**LONG_REQUEST, "prompt": "hi"}, timeout=60)
        taken = server.wait_for_metric(ADMITTED, STREAMED_ENGINE_REQUESTS + 1.0)
        assert taken == STREAMED_ENGINE_REQUESTS + 1.0, "the plain request should be in the engine before the signal"

        server.process.send_signal(sig)

        for first, events in zip(firsts, streams):
            assert_ended_by_shutdown([first, *events])
        answer = plain.result(timeout=60)
        signal_all(engines, signal.SIGCONT)
        assert_error(answer, 503, type="service_unavailable")
        assert int(answer.headers["retry-after"]) >= 1
        assert "shutting down" in answer.json()["error"]["message"]
        returncode = server.process.wait(timeout=60)
        wait_until(lambda: not any(pid_alive(pid) for pid in engines), 30, "the engine outlived the server")
    log = server.log()
    assert returncode == 0, log
    assert "Traceback" not in log, log
    assert f"requests in flight at the shutdown deadline: {STREAMED_ENGINE_REQUESTS + 1};" in log, log


def _engines_die_with_the_server(server: ServerProcess, names: list[str]) -> None:
    with server:
        engines = [pid for name in names for pid in server.engine_pids(name)]
        signal_all(engines, signal.SIGSTOP)
        server.process.kill()
        server.process.wait(timeout=30)
        wait_until(lambda: not any(pid_alive(pid) for pid in engines), 30, f"{names} outlived the server")


def test_a_killed_server_takes_its_engine_along(model_dir: str) -> None:
    _engines_die_with_the_server(ServerProcess(model_dir, "--served-model-name", MODEL), [ENGINE])


@pytest.mark.slow  # three processes start
def test_a_killed_disaggregated_server_takes_its_engines_along(model_dir: str) -> None:
    flags = ["--prefill-workers", "1", "--decode-workers", "1", *DISAGGREGATED_FLAGS]
    server = ServerProcess(model_dir, *flags, "--served-model-name", MODEL)
    _engines_die_with_the_server(server, [ROLE_NAMES["prefill"], ROLE_NAMES["decode"]])
