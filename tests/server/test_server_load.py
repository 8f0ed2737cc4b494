"""`cadence serve` under load and when things go away, end to end against real servers.

- `busy`: two sequence slots and no waiting room (429 with Retry-After);
- `roomy`: default limits, for long wide requests whose clients go away (disconnects),
  then SIGTERM mid-stream (graceful drain) as its last test;
- `doomed`: its engine is killed and, with `--engine-restart never`, stays dead (503s, an
  error event mid-stream). Restarts are in test_engine_restart.py.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_checks import (
    CHAT,
    CMPL,
    GENERATED,
    LONG,
    MESSAGES,
    MODEL,
    RUNNING,
    VOCAB_SIZE,
    assert_error,
    assert_idle,
    assert_serves,
    finished_count,
    kill_engine_mid_requests,
    sse_data,
)
from tests.support.server_harness import ServerProcess, pid_alive


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def busy(model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, "--served-model-name", MODEL, "--max-num-seqs", "2", "--max-waiting", "0") as server:
        yield server


@pytest.fixture(scope="module")
def doomed(model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, "--served-model-name", MODEL, "--engine-restart", "never") as server:
        yield server


@pytest.fixture(scope="module")
def roomy(model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, "--served-model-name", MODEL) as server:
        yield server


# ----- 429 --------------------------------------------------------------------------------
def _long_stream_body(max_tokens: int = LONG) -> dict[str, Any]:
    """A streamed request that takes both seats of the busy server for a second or more.

    The penalties and top-p/top-k only slow the sampler down, to widen the window.
    """
    return {
        "model": MODEL,
        "prompt": "The quick brown",
        "n": 2,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "presence_penalty": 0.5,
        "top_p": 0.9,
        "top_k": 50,
    }


@contextmanager
def _seats_taken(busy: ServerProcess) -> Iterator[None]:
    """Both seats of the busy server held by one streamed n=2 request for the block inside,
    then the stream closed, which aborts it and frees them. The tiny model generates the
    request's tokens in about a second, so each block holds one refusal only, and the
    request is checked running when the block starts and still running (not finished on
    its own) when it ends."""
    with (
        httpx.Client(timeout=30) as holder,
        holder.stream("POST", f"{busy.base_url}{CMPL}", json=_long_stream_body()) as held,
    ):
        assert held.status_code == 200
        events = sse_data(held.iter_lines())  # kept: a dropped line iterator closes the stream
        assert json.loads(next(events))["choices"]
        # The gauge follows the engine's step stats, which may trail the first event.
        assert busy.wait_for_metric(RUNNING, 2.0) == 2.0
        yield
        assert busy.metric(RUNNING) == 2.0, "the held request ended too soon for this test"
    assert_idle(busy)


def test_overload_gives_429_with_retry_after(busy: ServerProcess) -> None:
    url = busy.base_url
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    with httpx.Client(base_url=url, timeout=30) as client:
        # While both seats are taken, every new request is refused at once.
        for path, body in (
            (CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
            (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
            (CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}),
        ):
            with _seats_taken(busy):
                response = client.post(path, json=body)
            assert_error(response, 429, type="rate_limit_error", code="rate_limit_exceeded")
            assert response.headers["retry-after"] == "1"
        with _seats_taken(busy), pytest.raises(openai.RateLimitError) as caught:
            sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert caught.value.response.headers["retry-after"] == "1"
        with _seats_taken(busy), pytest.raises(openai.RateLimitError):
            sdk.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
        # Each closed held stream was aborted and gave both seats back (``_seats_taken``).
        completion = sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert completion.choices[0].finish_reason in ("length", "stop")
        response = client.post(CMPL, json={"model": MODEL, "prompt": "hi", "n": 2, "max_tokens": 2})
        assert response.status_code == 200, response.text


def test_429_after_a_finished_request_frees_its_seats(busy: ServerProcess) -> None:
    """Seats held by a request that finishes on its own (not aborted) are given back."""
    finished_before = finished_count(busy)
    with (
        httpx.Client(timeout=30) as holder,
        holder.stream("POST", f"{busy.base_url}{CMPL}", json=_long_stream_body(max_tokens=300)) as held,
    ):
        events = sse_data(held.iter_lines())
        next(events)
        response = httpx.post(
            f"{busy.base_url}{CMPL}", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30
        )
        assert_error(response, 429, type="rate_limit_error")
        rest = list(events)
    assert rest[-1] == "[DONE]"
    choices = [c for e in rest[:-1] for c in json.loads(e)["choices"]]
    finishes = {c["index"]: c["finish_reason"] for c in choices if c["finish_reason"]}
    assert finishes == {0: "length", 1: "length"}
    assert_idle(busy)
    assert finished_count(busy) == finished_before + 2
    response = httpx.post(
        f"{busy.base_url}{CMPL}", json={"model": MODEL, "prompt": "hi", "n": 2, "max_tokens": 2}, timeout=30
    )
    assert response.status_code == 200, response.text


def test_request_the_server_can_never_hold_is_400_not_429(busy: ServerProcess) -> None:
    """n above max_num_seqs + max_waiting can never be admitted: retrying (429) cannot help."""
    assert_idle(busy)
    response = httpx.post(
        f"{busy.base_url}{CMPL}", json={"model": MODEL, "prompt": "hi", "n": 3, "max_tokens": 2}, timeout=30
    )
    assert_error(response, 400, type="invalid_request_error", param="n")
    assert "retry-after" not in response.headers


def test_refusals_leave_no_seat_taken(busy: ServerProcess) -> None:
    """Requests refused at the edge or by the engine must not keep admission slots."""
    for extra in ({"priority": 2**64}, {"top_k": 2**64}, {"stop_token_ids": [2**64]}, {"stop_token_ids": [VOCAB_SIZE]}):
        response = httpx.post(
            f"{busy.base_url}{CMPL}",
            json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "n": 2, **extra},
            timeout=30,
        )
        assert_error(response, 400)
    # Both seats are free: a request that needs both is served.
    response = httpx.post(
        f"{busy.base_url}{CMPL}", json={"model": MODEL, "prompt": "hi", "max_tokens": 3, "n": 2}, timeout=30
    )
    assert response.status_code == 200, response.text


def test_busy_server_still_serves_and_is_idle(busy: ServerProcess) -> None:
    assert_serves(busy)
    assert_idle(busy)


# ----- disconnects ------------------------------------------------------------------------
# Many sequences at once, so that one request takes seconds even on a fast machine.
WIDE = 64


def _assert_aborted(server: ServerProcess, generated_at_hang_up: float, finished_before: float, budget: int) -> None:
    """The engine dropped the request: idle, and few tokens generated after the hang-up.

    Counted from the hang-up, not from the request's start, so that the bound does not
    depend on how fast this machine generates.
    """
    assert_idle(server)
    generated = server.metric(GENERATED)
    time.sleep(0.5)
    assert server.metric(GENERATED) == generated, "tokens are still being generated"
    assert generated - generated_at_hang_up < budget / 2, (generated - generated_at_hang_up, budget)
    # An aborted request is not a finished one.
    assert finished_count(server) == finished_before, "no aborted sequence may count as finished"


def _post_and_hang_up(server: ServerProcess, path: str, body: dict[str, Any]) -> float:
    """Send a request without streaming, wait until all its sequences run, then close the
    connection unread, as a client whose read timed out does. Returns the engine's token
    count at the hang-up.

    A raw socket rather than a client timeout: a fixed timeout is either too short for a
    slow machine to start the request or long enough for a fast one to finish it.
    """
    payload = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {server.host}:{server.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    with socket.create_connection((server.host, server.port), timeout=30) as connection:
        connection.sendall(head.encode() + payload)
        assert server.wait_for_metric(RUNNING, body["n"]) == body["n"], "the request should be in the engine"
    return server.metric(GENERATED)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_streaming_client_disconnect_aborts(roomy: ServerProcess, path: str) -> None:
    body = {"model": MODEL, "n": WIDE, "max_tokens": LONG, "ignore_eos": True, "stream": True}
    body.update({"prompt": "The quick brown"} if path == CMPL else {"messages": MESSAGES})
    # The client reads one event, stalls (so the server is blocked sending, not waiting for
    # the engine, when the connection goes) and then hangs up. A few times, since what
    # the server is doing at that moment still varies.
    for _ in range(4):
        assert_idle(roomy)
        finished_before = finished_count(roomy)
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{roomy.base_url}{path}", json=body) as response,
        ):
            assert response.status_code == 200
            events = sse_data(response.iter_lines())
            assert json.loads(next(events))["choices"]
            assert roomy.wait_for_metric(RUNNING, WIDE) == WIDE
            time.sleep(0.5)
            # Leaving the block closes the connection with the answer half read.
        _assert_aborted(roomy, roomy.metric(GENERATED), finished_before, budget=WIDE * LONG)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_non_streaming_client_timeout_aborts(roomy: ServerProcess, path: str) -> None:
    assert_idle(roomy)
    finished_before = finished_count(roomy)
    aborted_before = finished_count(roomy, aborted=True)
    body = {"model": MODEL, "n": WIDE, "max_tokens": LONG, "ignore_eos": True}
    body.update({"prompt": "The quick brown"} if path == CMPL else {"messages": MESSAGES})
    generated_at_hang_up = _post_and_hang_up(roomy, path, body)
    _assert_aborted(roomy, generated_at_hang_up, finished_before, budget=WIDE * LONG)
    assert finished_count(roomy, aborted=True) == aborted_before + WIDE


def test_roomy_server_still_serves_and_is_idle(roomy: ServerProcess) -> None:
    assert_serves(roomy)
    assert_idle(roomy)


# ----- engine death -----------------------------------------------------------------------
def test_engine_death_fails_requests_with_503(doomed: ServerProcess) -> None:
    url = doomed.base_url
    # 16 sequences each, so that both are still generating when the engine dies.
    kill_engine_mid_requests(doomed, 16)

    health = httpx.get(f"{url}/health", timeout=30)
    assert_error(health, 503, type="service_unavailable")
    assert health.headers["retry-after"] == "1"
    assert doomed.metric("cadence:engine_healthy") == 0.0

    for path, request in (
        (CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
        (CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
        (CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "stream": True}),
    ):
        response = httpx.post(f"{url}{path}", json=request, timeout=30)
        assert_error(response, 503, type="service_unavailable")
        assert response.headers["retry-after"] == "1"
    sdk = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=30)
    with pytest.raises(openai.InternalServerError) as caught:
        sdk.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert caught.value.status_code == 503
    # The HTTP side itself stays up to say so.
    assert doomed.process.poll() is None


# ----- SIGTERM drain ----------------------------------------------------------------------
def test_sigterm_drains_in_flight_stream(roomy: ServerProcess) -> None:
    draining = roomy  # the last test on this server: it does not survive this one
    assert_idle(draining)
    engine_pid = draining.engine_pid
    body = {
        "model": MODEL,
        "prompt": "The quick brown",
        "max_tokens": 200,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.Client(timeout=30) as client, client.stream("POST", f"{draining.base_url}{CMPL}", json=body) as response:
        assert response.status_code == 200
        events = sse_data(response.iter_lines())
        first = json.loads(next(events))
        assert first["choices"][0]["finish_reason"] is None
        draining.process.send_signal(signal.SIGTERM)
        rest = list(events)
    assert rest[-1] == "[DONE]", rest[-3:]
    chunks = [json.loads(e) for e in rest[:-1]]
    assert all("error" not in c for c in chunks), chunks[-2:]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finishes[-1] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    text = first["choices"][0]["text"] + "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text

    returncode = draining.process.wait(timeout=30)
    deadline = time.monotonic() + 10
    while pid_alive(engine_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_alive(engine_pid), "the engine process outlived the server"
    assert returncode == 0, f"server exited with {returncode} after SIGTERM:\n{draining.log()}"
