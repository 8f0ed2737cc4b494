"""Shared checks for the server's error and load tests: OpenAI error bodies, idleness."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from openai.types.chat import ChatCompletionMessageParam

from tests.support.server_harness import ServerProcess

MODEL = "tiny"
API_KEY = "secret"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
STRICT_MAX_MODEL_LEN = 64
BODY_LIMIT = 4096
VOCAB_SIZE = 512
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
# A long generation: the tiny model's context minus room for the prompt.
LONG = 480

RUNNING = "cadence:num_requests_running"
WAITING = "cadence:num_requests_waiting"
KV_USAGE = "cadence:kv_cache_usage_perc"
GENERATED = "cadence:generation_tokens_total"
FINISHED = "cadence:request_success_total"
CMPL = "/v1/completions"
CHAT = "/v1/chat/completions"


def assert_error(
    response: httpx.Response,
    status: int,
    *,
    type: str | None = None,
    param: Any = ...,
    code: Any = ...,
) -> dict[str, Any]:
    """Assert an OpenAI-shaped error answer with this status; return its error object."""
    assert response.status_code == status, f"{response.status_code}: {response.text}"
    assert response.headers["content-type"].startswith("application/json"), response.headers
    return assert_error_body(response.json(), type=type, param=param, code=code)


def assert_error_body(body: Any, *, type: str | None = None, param: Any = ..., code: Any = ...) -> dict[str, Any]:
    """Assert `{"error": {"message": str, "type": str, "param": str|None, "code": str|None}}` exactly."""
    assert isinstance(body, dict) and set(body) == {"error"}, body
    error = body["error"]
    assert isinstance(error, dict) and set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    assert isinstance(error["type"], str) and error["type"], error
    assert error["param"] is None or isinstance(error["param"], str), error
    assert error["code"] is None or isinstance(error["code"], str), error
    if type is not None:
        assert error["type"] == type, error
    if param is not ...:
        assert error["param"] == param, error
    if code is not ...:
        assert error["code"] == code, error
    return error


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The payloads of the `data:` lines of a server-sent event stream."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def assert_idle(server: ServerProcess, timeout: float = 10.0) -> None:
    """Nothing running or waiting and no KV block in use."""
    for name in (RUNNING, WAITING, KV_USAGE):
        assert server.wait_for_metric(name, 0.0, timeout) == 0.0, (name, server.log())


def assert_serves(server: ServerProcess, headers: dict[str, str] | None = None) -> None:
    """A normal completions and chat request still succeed."""
    completion = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": MODEL, "prompt": "The quick brown", "max_tokens": 5, "ignore_eos": True},
        headers=headers,
        timeout=30,
    )
    assert completion.status_code == 200, completion.text
    assert completion.json()["usage"]["completion_tokens"] == 5
    chat = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": MESSAGES, "max_tokens": 5, "ignore_eos": True},
        headers=headers,
        timeout=30,
    )
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] == "length"


def finished_count(server: ServerProcess, aborted: bool = False) -> float:
    """Sequences that ended by finishing (stop/length), or by abort with `aborted=True`."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(FINISHED + "{") and ('finished_reason="abort"' in line) == aborted:
            total += float(line.rsplit(" ", 1)[1])
    return total


def post(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    headers = {**AUTH, **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}{path}", json=body, headers=headers, timeout=30, **kwargs)


def kill_engine_mid_requests(server: ServerProcess, n: int) -> int:
    """Kill the engine while a streamed completion and a plain chat request (n sequences
    each) generate; check that both fail as they should (an error event then [DONE] in
    the stream, 503 with Retry-After for the other). Returns the engine steps counted
    just before the kill."""
    url = server.base_url
    body = {"model": MODEL, "n": n, "max_tokens": LONG, "ignore_eos": True}
    with (
        ThreadPoolExecutor(1) as pool,
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{url}{CMPL}", json={**body, "prompt": "The quick brown", "stream": True}) as streamed,
    ):
        events = sse_data(streamed.iter_lines())
        assert json.loads(next(events))["choices"]
        plain = pool.submit(httpx.post, f"{url}{CHAT}", json={**body, "messages": MESSAGES}, timeout=30)
        assert server.wait_for_metric(RUNNING, 2.0 * n) == 2.0 * n, "both requests should be in the engine"
        steps = server.metric("cadence:engine_steps_total")

        os.kill(server.engine_pid, signal.SIGKILL)

        rest = list(events)
        response = plain.result(timeout=30)
    assert rest[-1] == "[DONE]", rest[-3:]
    assert_error_body(json.loads(rest[-2]), type="service_unavailable", code="service_unavailable")
    assert all("error" not in json.loads(e) for e in rest[:-2])
    assert_error(response, 503, type="service_unavailable")
    assert response.headers["retry-after"] == "1"
    return int(steps)
