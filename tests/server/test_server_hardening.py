"""`cadence serve` against a hostile or unlucky client, end to end against a real server:
lone surrogates, non-finite numbers, a key checked before the body, a 10 MB prompt while
another request streams, and what the API process keeps after big bodies."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from cadence.server.errors import install_error_handlers
from cadence.server.guards import install_guards
from tests.support.server_checks import (
    API_KEY,
    AUTH,
    CHAT,
    CMPL,
    MESSAGES,
    MODEL,
    VOCAB_SIZE,
    assert_error,
    assert_error_body,
    assert_idle,
    assert_serves,
    sse_data,
)
from tests.support.server_harness import ServerProcess


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str]) -> Iterator[ServerProcess]:
    with ServerProcess(
        tiny_model_dir("llama"), "--served-model-name", MODEL, "--api-key", API_KEY, "--protect-metrics"
    ) as running:
        running.metrics_headers = AUTH
        yield running


def post_raw(server: ServerProcess, path: str, body: Any, **kwargs: Any) -> httpx.Response:
    """POST `body` as JSON with non-ASCII escaped, so lone surrogates travel as \\udXXX."""
    content = json.dumps(body).encode("ascii")
    headers = {**AUTH, "Content-Type": "application/json"}
    return httpx.post(f"{server.base_url}{path}", content=content, headers=headers, timeout=30, **kwargs)


def _user(content: Any, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content, **extra}], "max_tokens": 2}


SURROGATES = [
    ("cmpl-prompt", CMPL, {"model": MODEL, "prompt": "a\ud800b", "max_tokens": 4}, "prompt"),
    ("cmpl-prompt-list", CMPL, {"model": MODEL, "prompt": ["fine", "a\udc80"], "max_tokens": 4}, "prompt.1"),
    ("cmpl-stop", CMPL, {"model": MODEL, "prompt": "hi", "stop": "\udfff"}, "stop"),
    ("cmpl-stop-list", CMPL, {"model": MODEL, "prompt": "hi", "stop": ["ok", "x\ud800"]}, "stop.1"),
    ("cmpl-model", CMPL, {"model": "tiny\ud800", "prompt": "hi"}, "model"),
    ("chat-content", CHAT, _user("\ud83d"), "messages.0.content"),
    ("chat-part", CHAT, _user([{"type": "text", "text": "x\udc80"}]), "messages.0.content.0.text"),
    ("chat-name", CHAT, _user("hi", name="bob\ud800"), "messages.0.name"),
    ("chat-stop", CHAT, {**_user("hi"), "stop": ["\ud800"]}, "stop.0"),
    ("tokenize-prompt", "/tokenize", {"prompt": "\udc80"}, "prompt"),
    ("tokenize-messages", "/tokenize", {"messages": [{"role": "user", "content": "a\ud800"}]}, "messages.0.content"),
]


@pytest.mark.parametrize(("path", "body", "param"), [c[1:] for c in SURROGATES], ids=[c[0] for c in SURROGATES])
def test_lone_surrogate_is_400_naming_the_field(server: ServerProcess, path: str, body: Any, param: str) -> None:
    assert "\\ud" in json.dumps(body)  # the escape really travels
    error = assert_error(post_raw(server, path, body), 400, type="invalid_request_error", param=param)
    assert "surrogate" in error["message"], error


def test_a_surrogate_does_not_hide_other_fields_errors(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "a\ud800", "temperature": -1}
    error = assert_error(post_raw(server, CMPL, body), 400, type="invalid_request_error")
    assert "surrogate" in error["message"] and "temperature" in error["message"], error


def test_connection_stays_usable_after_a_refusal(server: ServerProcess) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    headers = {**AUTH, "Content-Type": "application/json"}
    try:
        connection.request("POST", CMPL, json.dumps({"model": MODEL, "prompt": "a\ud800b"}), headers)
        first = connection.getresponse()
        assert first.status == 400
        assert not first.will_close, first.getheaders()
        first.read()
        sock = connection.sock
        body = {"model": MODEL, "prompt": "The quick brown", "max_tokens": 3}
        connection.request("POST", CMPL, json.dumps(body), headers)
        second = connection.getresponse()
        assert second.status == 200
        assert json.loads(second.read())["usage"]["completion_tokens"] == 3
        assert connection.sock is sock, "the server closed the connection after the 400"
    finally:
        connection.close()


def test_every_token_detokenizes_to_json(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.base_url, headers=AUTH, timeout=30) as client:
        whole = client.post("/detokenize", json={"tokens": list(range(VOCAB_SIZE))})
        assert whole.status_code == 200, whole.text
        assert isinstance(whole.json()["prompt"], str)
        for token in range(VOCAB_SIZE):
            one = client.post("/detokenize", json={"tokens": [token]})
            assert one.status_code == 200, (token, one.text)
            one.json()["prompt"].encode("utf-8")  # strict UTF-8: no surrogate got through


NON_FINITE = [
    ("temperature", "Infinity"),
    ("temperature", "1e308"),
    ("temperature", "NaN"),
    ("repetition_penalty", "Infinity"),
    ("repetition_penalty", "1e308"),
    ("presence_penalty", "-Infinity"),
    ("top_p", "NaN"),
    ("min_p", "Infinity"),
]


@pytest.mark.parametrize(("field", "value"), NON_FINITE, ids=[f"{f}={v}" for f, v in NON_FINITE])
@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_non_finite_number_is_400(server: ServerProcess, path: str, field: str, value: str) -> None:
    # Python's json module (and the server's parser) read these bare words as floats.
    payload = {"model": MODEL, "max_tokens": 2, **({"prompt": "hi"} if path == CMPL else {"messages": MESSAGES})}
    content = json.dumps(payload)[:-1] + f', "{field}": {value}}}'
    response = httpx.post(
        f"{server.base_url}{path}",
        content=content,
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert_error(response, 400, type="invalid_request_error", param=field)


def _raw_post(port: int, headers: str, timeout: float) -> tuple[bytes, bool]:
    """Send only a request's head (its body never comes); return what the server answers
    within `timeout`, and whether it then closed the connection."""
    received = b""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as conn:
        conn.sendall(headers.encode())
        try:
            while chunk := conn.recv(4096):
                received += chunk
        except TimeoutError:
            return received, False
    return received, True


def test_api_key_is_checked_before_the_body_is_read(server: ServerProcess) -> None:
    head = (
        f"POST {CMPL} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {10 << 20}\r\n"
    )
    refused, closed = _raw_post(server.port, head + "\r\n", timeout=10)
    assert refused.startswith(b"HTTP/1.1 401"), refused[:200]
    # The server closes the connection rather than read the body it will not serve.
    assert b"connection: close" in refused.lower() and closed, refused[:300]
    # With the key, the server does wait for the promised body: the 401 above was not
    # just an answer to a body that never came.
    waiting, closed = _raw_post(server.port, head + f"Authorization: Bearer {API_KEY}\r\n\r\n", timeout=2)
    assert waiting == b"" and not closed, waiting[:200]


def test_metrics_need_the_key_when_protected(server: ServerProcess) -> None:
    assert_error(httpx.get(f"{server.base_url}/metrics", timeout=30), 401, code="invalid_api_key")
    metrics = httpx.get(f"{server.base_url}/metrics", headers=AUTH, timeout=30)
    assert metrics.status_code == 200 and "cadence:engine_restarts_total" in metrics.text
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_huge_prompts_are_refused_while_a_stream_keeps_its_pace(server: ServerProcess) -> None:
    arrivals: list[float] = []
    body = {"model": MODEL, "prompt": "The quick", "max_tokens": 400, "ignore_eos": True, "stream": True}

    def stream() -> None:
        with httpx.stream("POST", f"{server.base_url}{CMPL}", json=body, headers=AUTH, timeout=60) as response:
            for _ in sse_data(response.iter_lines()):
                arrivals.append(time.monotonic())

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        while len(arrivals) < 5:
            time.sleep(0.05)
        before = _rss_mib(server.process.pid)
        refusing = time.monotonic()
        piece = "héllo wörld, "  # 13 characters, 15 bytes
        big = piece * (10_000_000 // 15)
        for prompt_body, param in (
            ({"model": MODEL, "prompt": big, "max_tokens": 4}, "prompt"),
            ({"model": MODEL, "prompt": piece * (15_000_000 // 15), "max_tokens": 4}, "prompt"),
            ({"model": MODEL, "messages": [{"role": "user", "content": big}]}, "messages"),
        ):
            content = json.dumps(prompt_body, ensure_ascii=False).encode()
            assert 10_000_000 <= len(content) < 16 << 20
            refused = httpx.post(
                f"{server.base_url}{CHAT if 'messages' in prompt_body else CMPL}",
                content=content,
                headers={**AUTH, "Content-Type": "application/json"},
                timeout=60,
            )
            error = assert_error(refused, 400, param=param, code="context_length_exceeded")
            # Refused on its characters, so before anything tokenized it.
            assert "characters" in error["message"], error
        over_limit = httpx.post(
            f"{server.base_url}{CMPL}",
            content=b"x" * (20 << 20),
            headers={**AUTH, "Content-Type": "application/json"},
            timeout=60,
        )
        assert_error(over_limit, 413, code="request_too_large")
        refused_all = time.monotonic()
        grown = _rss_mib(server.process.pid) - before
    finally:
        reader.join(timeout=60)
    assert len(arrivals) > 100, "the stream should have run through the refusals"
    # It kept its pace: tokens reached it while the server took in and refused the huge bodies,
    # not only once they were done with.
    assert any(refusing < at < refused_all for at in arrivals), "the stream stalled while the refusals ran"
    # Big bodies leave no big buffers behind (they once kept over a gigabyte).
    assert grown < 200, f"the API process grew by {grown:.0f} MiB"


def test_hardened_server_still_serves_and_is_idle(server: ServerProcess) -> None:
    assert_serves(server, AUTH)
    assert_idle(server)


# ----- the last-resort error guard, without a server -------------------------------------
def _failing_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    install_guards(app, None, (), 1 << 20)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("a bug")

    @app.get("/boom-later")
    async def boom_later() -> StreamingResponse:
        async def events() -> Iterator[str]:  # type: ignore[misc]
            yield "data: one\n\n"
            raise RuntimeError("a bug mid-stream")

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def test_unexpected_error_is_a_500_with_openai_body() -> None:
    import asyncio

    async def run() -> None:
        transport = httpx.ASGITransport(app=_failing_app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            # Answered, not raised: uvicorn sees a finished response and keeps the connection.
            response = await client.get("/boom")
            assert response.status_code == 500
            assert_error_body(response.json(), type="server_error")
            assert "RuntimeError" in response.json()["error"]["message"]
            # Half an answer cannot be turned into a 500: the error goes on, and the
            # server closes the connection.
            with pytest.raises(RuntimeError, match="mid-stream"):
                await client.get("/boom-later")

    asyncio.run(run())
