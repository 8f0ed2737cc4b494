"""cadence.client without a server: its retries, streams, timeouts and errors against
httpx.MockTransport, with a recorded sleep instead of a real one, and metrics parsing."""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any

import httpx
import pytest

from cadence.client import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    BadRequestError,
    CadenceError,
    Client,
    InternalServerError,
    RetryPolicy,
    ServiceUnavailableError,
    metric_value,
    parse_metrics,
)
from cadence.client.errors import APIStatusError
from cadence.client.retry import parse_retry_after
from cadence.openai_schema.responses import (
    CompletionChoice,
    CompletionResponse,
    CompletionStreamChoice,
    CompletionStreamResponse,
    ErrorDetail,
    ErrorResponse,
    Usage,
)

BASE = "http://cadence.test"
COMPLETION = CompletionResponse(
    id="cmpl-1",
    created=0,
    model="tiny",
    choices=[CompletionChoice(index=0, text="hi", finish_reason="length")],
    usage=Usage(prompt_tokens=1, completion_tokens=1, total_tokens=2),
)


def error_answer(status: int, type: str, message: str = "busy", **headers: str) -> httpx.Response:
    body = ErrorResponse(error=ErrorDetail(message=message, type=type, code=type)).model_dump()
    return httpx.Response(status, json=body, headers=headers)


def mocked(handler: Callable[[httpx.Request], httpx.Response], **options: Any) -> tuple[Client, list[float]]:
    """A client answered by `handler`, and the waits it would have slept."""
    sleeps: list[float] = []
    options.setdefault("retry", RetryPolicy(rng=random.Random(0)))
    made = Client(BASE, transport=httpx.MockTransport(handler), sleep=sleeps.append, **options)
    return made, sleeps


def scripted(*answers: httpx.Response | Exception) -> tuple[Callable[[httpx.Request], httpx.Response], list]:
    """A handler giving `answers` in turn (an exception is raised), then the last again."""
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        answer = answers[min(len(seen), len(answers)) - 1]
        if isinstance(answer, Exception):
            raise answer
        return answer

    return handle, seen


def test_429_is_retried_once_after_its_retry_after() -> None:
    handler, seen = scripted(
        error_answer(429, "rate_limit_error", **{"Retry-After": "2"}),
        httpx.Response(200, content=COMPLETION.model_dump_json()),
    )
    made, sleeps = mocked(handler)
    assert made.completions("x", model="tiny") == COMPLETION
    assert len(seen) == 2 and sleeps == [2.0]


def test_retry_after_as_an_http_date_and_its_cap() -> None:
    now = datetime(2030, 1, 1, tzinfo=timezone.utc)
    assert parse_retry_after(format_datetime(now + timedelta(seconds=7), usegmt=True), now.timestamp()) == 7.0
    assert parse_retry_after("soon") is None
    handler, _ = scripted(
        error_answer(503, "service_unavailable", **{"Retry-After": "3600"}),
        httpx.Response(200, content=COMPLETION.model_dump_json()),
    )
    made, sleeps = mocked(handler, retry=RetryPolicy(max_retry_after=5.0))
    made.completions("x", model="tiny")
    assert sleeps == [5.0]


def test_503_past_max_retries_raises_with_the_body() -> None:
    handler, seen = scripted(error_answer(503, "service_unavailable", "the engine is restarting"))
    made, sleeps = mocked(handler, max_retries=3)
    with pytest.raises(ServiceUnavailableError) as caught:
        made.completions("x", model="tiny")
    assert len(seen) == 4 and len(sleeps) == 3
    assert caught.value.body is not None and caught.value.body.error.message == "the engine is restarting"
    assert caught.value.code == "service_unavailable"


def test_other_errors_are_not_retried() -> None:
    for status, kind, cls in [
        (400, "invalid_request_error", BadRequestError),
        (500, "server_error", InternalServerError),
    ]:
        handler, seen = scripted(error_answer(status, kind))
        made, sleeps = mocked(handler)
        with pytest.raises(cls):
            made.completions("x", model="tiny")
        assert len(seen) == 1 and sleeps == []
    # An answer that is not an error body still raises its status's class, with the text.
    handler, _ = scripted(httpx.Response(502, text="bad gateway"))
    made, _ = mocked(handler, max_retries=0)
    with pytest.raises(APIStatusError) as caught:
        made.models()
    assert caught.value.status_code == 502 and caught.value.body is None and "bad gateway" in str(caught.value)


def test_connection_errors_are_retried_then_raised() -> None:
    handler, seen = scripted(httpx.ConnectError("refused"))
    made, sleeps = mocked(handler, max_retries=2)
    with pytest.raises(APIConnectionError) as caught:
        made.models()
    assert not isinstance(caught.value, APITimeoutError)
    assert len(seen) == 3 and len(sleeps) == 2
    # Recovering on the way: the answer after two failures is returned.
    handler, seen = scripted(
        httpx.ConnectError("refused"),
        httpx.RemoteProtocolError("closed"),
        httpx.Response(200, content=COMPLETION.model_dump_json()),
    )
    made, _ = mocked(handler, max_retries=2)
    assert made.completions("x", model="tiny") == COMPLETION and len(seen) == 3


def test_backoff_grows_and_jitter_stays_in_bounds() -> None:
    error = APIConnectionError("refused")
    plain = RetryPolicy(max_retries=6, initial_backoff=0.5, max_backoff=4.0, jitter="none").attempts()
    assert [plain.next_delay(error) for _ in range(7)] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, None]
    full = RetryPolicy(max_retries=200, initial_backoff=0.5, max_backoff=4.0, rng=random.Random(1)).attempts()
    delays = [d for d in (full.next_delay(error) for _ in range(200)) if d is not None]
    assert len(delays) == 200
    ceilings = [min(4.0, 0.5 * 2**i) for i in range(200)]
    assert all(0.0 <= d <= c for d, c in zip(delays, ceilings))
    assert len(set(delays)) == len(delays)  # jittered, not the ceiling
    assert max(delays[-100:]) > 3.0 > max(delays[:2])
    policy = RetryPolicy(
        max_retries=200, initial_backoff=0.5, max_backoff=4.0, jitter="decorrelated", rng=random.Random(1)
    )
    decorrelated = policy.attempts()
    previous = 0.5
    for _ in range(200):
        delay = decorrelated.next_delay(error)
        assert delay is not None and 0.5 <= delay <= min(4.0, 3 * previous)
        previous = delay


def sse_body(*events: str) -> bytes:
    return "".join(f"data: {e}\n\n" for e in events).encode()


CHUNK = CompletionStreamResponse(
    id="cmpl-1", created=0, model="tiny", choices=[CompletionStreamChoice(index=0, text="hi")]
).model_dump_json()


class BreaksAfter(httpx.SyncByteStream):
    """A body that sends `first`, then loses the connection."""

    def __init__(self, first: bytes) -> None:
        self.first = first

    def __iter__(self) -> Iterator[bytes]:
        yield self.first
        raise httpx.ReadError("connection reset by peer")


def stream_answer(body: bytes | httpx.SyncByteStream) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    return httpx.Response(200, stream=body, headers={"content-type": "text/event-stream"})


def test_a_stream_is_retried_before_its_body_but_never_after() -> None:
    handler, seen = scripted(error_answer(503, "service_unavailable"), stream_answer(sse_body(CHUNK, CHUNK, "[DONE]")))
    made, sleeps = mocked(handler)
    assert [c.choices[0].text for c in made.completions_stream("x", model="tiny")] == ["hi", "hi"]
    assert len(seen) == 2 and len(sleeps) == 1
    handler, seen = scripted(stream_answer(BreaksAfter(sse_body(CHUNK))))
    made, sleeps = mocked(handler)
    got = []
    with pytest.raises(APIConnectionError):
        for chunk in made.completions_stream("x", model="tiny"):
            got.append(chunk)
    assert len(got) == 1 and len(seen) == 1 and sleeps == []


def test_stream_errors_in_the_body() -> None:
    error = ErrorResponse(error=ErrorDetail(message="the engine died", type="service_unavailable")).model_dump_json()
    handler, _ = scripted(stream_answer(sse_body(CHUNK, error, "[DONE]")))
    made, _ = mocked(handler)
    stream = made.completions_stream("x", model="tiny")
    assert next(iter(stream)).choices[0].text == "hi"
    with pytest.raises(ServiceUnavailableError) as caught:
        list(stream)
    assert caught.value.body is not None and caught.value.body.error.message == "the engine died"
    handler, _ = scripted(stream_answer(sse_body(CHUNK)))  # cut short: no [DONE]
    made, _ = mocked(handler)
    with pytest.raises(APIConnectionError, match="DONE"):
        list(made.completions_stream("x", model="tiny"))
    handler, _ = scripted(stream_answer(sse_body('{"not": "a chunk"}')))
    made, _ = mocked(handler)
    with pytest.raises(CadenceError, match="not a CompletionStreamResponse"):
        list(made.completions_stream("x", model="tiny"))


def test_per_call_timeout() -> None:
    # A listening socket that never answers: the connection opens, the answer never comes.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        sleeps: list[float] = []
        with Client(url, timeout=600, sleep=sleeps.append) as made:
            with pytest.raises(APITimeoutError) as caught:
                made.models(timeout=0.2)
            assert caught.value.phase == "read" and sleeps == []  # a read timeout is not retried
        with Client(
            url, timeout=0.2, retry=RetryPolicy(max_retries=1, retry_timeouts=True), sleep=sleeps.append
        ) as made:
            with pytest.raises(APITimeoutError):
                made.models()
            assert len(sleeps) == 1


def test_requests_carry_the_url_key_and_default_model() -> None:
    models = {
        "object": "list",
        "data": [{"id": "first", "created": 0, "owned_by": "x"}, {"id": "second", "created": 0, "owned_by": "x"}],
    }
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=models)
        return httpx.Response(200, content=COMPLETION.model_dump_json())

    made = Client(BASE + "/v1", api_key="secret", transport=httpx.MockTransport(handle))
    made.completions("a", max_tokens=3, extra_body={"top_k": 2, "custom": True})
    made.completions("b")
    assert [r.url.path for r in seen] == ["/v1/models", "/v1/completions", "/v1/completions"]
    assert all(r.headers["authorization"] == "Bearer secret" for r in seen)
    bodies = [json.loads(r.content) for r in seen[1:]]
    assert bodies[0] == {"model": "first", "prompt": "a", "max_tokens": 3, "top_k": 2, "custom": True}
    assert bodies[1]["model"] == "first"


def test_async_retries_with_mock_transport() -> None:
    handler, seen = scripted(
        error_answer(429, "rate_limit_error", **{"Retry-After": "1.5"}),
        httpx.Response(200, content=COMPLETION.model_dump_json()),
    )
    refusing, refused = scripted(error_answer(503, "service_unavailable"))
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def run() -> None:
        async with AsyncClient(BASE, transport=httpx.MockTransport(handler), sleep=sleep) as made:
            assert await made.completions("x", model="tiny") == COMPLETION
        async with AsyncClient(BASE, transport=httpx.MockTransport(refusing), sleep=sleep, max_retries=1) as made:
            with pytest.raises(ServiceUnavailableError):
                await made.completions("x", model="tiny")

    asyncio.run(run())
    assert len(seen) == 2 and len(refused) == 2
    assert sleeps[0] == 1.5 and len(sleeps) == 2


def test_parse_metrics() -> None:
    text = (
        "# HELP cadence:prompt_tokens_total Prompt tokens.\n"
        "# TYPE cadence:prompt_tokens_total counter\n"
        'cadence:prompt_tokens_total{model_name="tiny"} 12.0\n'
        "# HELP cadence:e2e_request_latency_seconds End to end.\n"
        "# TYPE cadence:e2e_request_latency_seconds histogram\n"
        'cadence:e2e_request_latency_seconds_bucket{le="0.5",model_name="tiny"} 1.0\n'
        'cadence:e2e_request_latency_seconds_bucket{le="+Inf",model_name="tiny"} 3.0\n'
        'cadence:e2e_request_latency_seconds_count{model_name="tiny"} 3.0\n'
        'cadence:e2e_request_latency_seconds_sum{model_name="tiny"} 2.5\n'
    )
    series = parse_metrics(text)
    assert metric_value(series, "cadence:prompt_tokens_total") == 12.0
    assert metric_value(series, "cadence:e2e_request_latency_seconds_bucket", le="+Inf") == 3.0
    assert metric_value(series, "cadence:e2e_request_latency_seconds_bucket") == 4.0
    assert series["cadence:e2e_request_latency_seconds_sum"][0].labels == {"model_name": "tiny"}
