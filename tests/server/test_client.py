"""cadence.client: against a live `cadence serve` on a tiny random model (compared with the
openai SDK on the same requests), and its retries, streams and errors against
httpx.MockTransport, with a recorded sleep instead of a real one."""

from __future__ import annotations

import asyncio
import json
import os
import random
import socket
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta, timezone
from email.utils import format_datetime
from typing import Any, cast

import httpx
import openai
import pytest

from cadence.client import (
    APIConnectionError,
    APITimeoutError,
    AsyncClient,
    BadRequestError,
    CadenceError,
    ChatMessage,
    Client,
    InternalServerError,
    NotFoundError,
    RetryPolicy,
    ServiceUnavailableError,
    metric_value,
    parse_metrics,
)
from cadence.client.errors import APIStatusError
from cadence.client.params import ToolCall
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
from tests.support.server_harness import ServerProcess

MESSAGES: list[ChatMessage] = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, "--num-gpu-blocks", "512", "--served-model-name", "tiny") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.base_url, max_retries=0) as made:
        yield made


@pytest.fixture(scope="module")
def sdk(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def eos_prompt(client: Client, model_dir: str) -> tuple[list[int], int, int]:
    """A prompt whose greedy answer ends on the model's EOS within 16 tokens: (prompt,
    tokens up to and with the EOS, the EOS id)."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        eos = json.load(f)["eos_token_id"]
    rng = random.Random(0)
    candidates = [[9, 10, 11, 12]] + [[rng.randrange(3, 500) for _ in range(5)] for _ in range(40)]
    for prompt in candidates:
        answer = client.completions(prompt, max_tokens=16, temperature=0)
        if answer.choices[0].finish_reason == "stop":
            assert answer.usage is not None
            return prompt, answer.usage.completion_tokens, eos
    raise AssertionError("no candidate prompt reaches EOS greedily; the test needs one")


def usage_numbers(usage: object) -> tuple[int, int, int]:
    return (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens)  # type: ignore[attr-defined]


def test_models_health_and_the_default_model(server: ServerProcess, client: Client) -> None:
    listed = client.models()
    assert [m.id for m in listed.data] == ["tiny"]
    assert listed.data[0].max_model_len == 512
    assert client.health() is True
    # No model named: the first one /v1/models lists, asked once; "/v1" in the URL is fine.
    with Client(server.base_url + "/v1/") as fresh:
        assert fresh.completions([5, 6, 7], max_tokens=2).model == "tiny"
        assert fresh.chat(MESSAGES, max_tokens=2).model == "tiny"


@pytest.mark.parametrize("prompt", ["The quick brown fox", [5, 6, 7]])
def test_completions_plain_and_streamed_match_the_openai_sdk(
    client: Client, sdk: openai.OpenAI, prompt: str | list[int]
) -> None:
    expected = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    got = client.completions(prompt, model="tiny", max_tokens=12, temperature=0)
    assert got.choices[0].text == expected.choices[0].text
    assert usage_numbers(got.usage) == usage_numbers(expected.usage)
    chunks = list(
        client.completions_stream(prompt, max_tokens=12, temperature=0, stream_options={"include_usage": True})
    )
    assert all(isinstance(c, CompletionStreamResponse) for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == got.usage
    # Without stream_options no chunk carries usage.
    assert all(c.usage is None for c in client.completions_stream(prompt, max_tokens=3, temperature=0))


def test_chat_plain_and_streamed_match_the_openai_sdk(client: Client, sdk: openai.OpenAI) -> None:
    expected = sdk.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0)  # type: ignore[arg-type]
    got = client.chat(MESSAGES, max_tokens=10, temperature=0)
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.choices[0].message.role == "assistant"
    assert usage_numbers(got.usage) == usage_numbers(expected.usage)
    with client.chat_stream(MESSAGES, max_tokens=10, temperature=0) as stream:
        chunks = list(stream)
    deltas = [c.choices[0].delta for c in chunks]
    assert deltas[0].role == "assistant" and all(d.role is None for d in deltas[1:])
    assert "".join(d.content or "" for d in deltas) == expected.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_tools_and_response_format_match_the_openai_sdk(client: Client, sdk: openai.OpenAI) -> None:
    named: dict[str, Any] = {"type": "function", "function": {"name": "get_weather"}}
    expected = sdk.chat.completions.create(  # type: ignore[call-overload]
        model="tiny", messages=MESSAGES, max_tokens=30, temperature=0, tools=[WEATHER_TOOL], tool_choice=named
    )
    got = client.chat(MESSAGES, max_tokens=30, temperature=0, tools=[WEATHER_TOOL], tool_choice=named)
    (call,) = got.choices[0].message.tool_calls or []
    (expected_call,) = expected.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather" and got.choices[0].finish_reason == "tool_calls"
    assert call.function.arguments == expected_call.function.arguments
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")
    # The call and a tool's answer go back as the next turn's messages.
    turn: list[ChatMessage] = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [cast(ToolCall, call.model_dump())]},
        {"role": "tool", "content": "sunny", "tool_call_id": call.id},
    ]
    assert client.chat(turn, max_tokens=4, temperature=0).choices[0].message.content is not None
    schema = WEATHER_TOOL["function"]["parameters"]
    response_format = {"type": "json_schema", "json_schema": {"name": "weather", "schema": schema}}
    answer = client.chat(MESSAGES, max_tokens=30, temperature=0, response_format=response_format)
    assert answer.choices[0].finish_reason == "stop"
    assert json.loads(answer.choices[0].message.content or "")["city"] in ("Paris", "Oslo")


def test_eos_ignore_eos_min_tokens_and_stop_token_ids(client: Client, eos_prompt: tuple[list[int], int, int]) -> None:
    prompt, to_eos, eos = eos_prompt
    assert to_eos < 16
    run_on = client.completions(prompt, max_tokens=16, temperature=0, ignore_eos=True)
    assert run_on.usage is not None and run_on.usage.completion_tokens == 16
    assert run_on.choices[0].finish_reason == "length"
    # The EOS id as a stop id ends the answer even with EOS ignored, and is named.
    stopped = client.completions(prompt, max_tokens=16, temperature=0, ignore_eos=True, stop_token_ids=[eos])
    assert stopped.choices[0].finish_reason == "stop" and stopped.choices[0].stop_reason == eos
    assert stopped.usage is not None and stopped.usage.completion_tokens == to_eos
    held = client.completions(prompt, max_tokens=16, temperature=0, min_tokens=to_eos + 2)
    assert held.usage is not None and held.usage.completion_tokens >= to_eos + 2


def test_top_k_min_p_and_repetition_penalty_are_honoured(client: Client, sdk: openai.OpenAI) -> None:
    prompt = [5, 6, 7]
    greedy = client.completions(prompt, max_tokens=16, temperature=0, ignore_eos=True).choices[0].text
    hot: dict[str, Any] = {"max_tokens": 16, "temperature": 50.0, "seed": 1, "ignore_eos": True}
    assert client.completions(prompt, **hot).choices[0].text != greedy
    assert client.completions(prompt, top_k=1, **hot).choices[0].text == greedy
    assert client.completions(prompt, min_p=1.0, priority=1, **hot).choices[0].text == greedy
    penalized = client.completions(prompt, max_tokens=32, temperature=0, repetition_penalty=3.0).choices[0].text
    assert penalized != client.completions(prompt, max_tokens=32, temperature=0).choices[0].text
    extra = {"repetition_penalty": 3.0}
    via_sdk = sdk.completions.create(model="tiny", prompt=prompt, max_tokens=32, temperature=0, extra_body=extra)
    assert via_sdk.choices[0].text == penalized


def test_tokenize_and_detokenize_round_trip(client: Client) -> None:
    text = "The quick brown fox"
    tokens = client.tokenize(text, add_special_tokens=False)
    assert tokens.count == len(tokens.tokens) > 0 and tokens.max_model_len == 512
    assert client.detokenize(tokens.tokens).prompt == text
    # The chat template's tokens are what a chat call is charged for.
    templated = client.tokenize(messages=MESSAGES)
    answer = client.chat(MESSAGES, max_tokens=1)
    assert answer.usage is not None and answer.usage.prompt_tokens == templated.count
    with pytest.raises(TypeError):
        client.tokenize(text, MESSAGES)


def test_metrics_count_the_generated_tokens(client: Client) -> None:
    before = client.metrics()
    client.completions([5, 6, 7], max_tokens=7, temperature=0, ignore_eos=True)
    after = client.metrics()
    generated = "cadence:generation_tokens_total"
    assert metric_value(after, generated) - metric_value(before, generated) == 7
    finished = "cadence:e2e_request_latency_seconds_count"
    assert metric_value(after, finished, model_name="tiny") - metric_value(before, finished, model_name="tiny") == 1
    assert metric_value(after, finished, model_name="other") == 0
    with pytest.raises(KeyError):
        metric_value(after, "cadence:generation_token_total")


def test_errors_carry_the_server_body(client: Client) -> None:
    with pytest.raises(BadRequestError) as caught:
        client.completions("x", max_tokens=-1)
    error = caught.value
    assert error.status_code == 400 and error.param == "max_tokens"
    assert error.body is not None and error.body.error.type == "invalid_request_error"
    assert error.request_id
    with pytest.raises(BadRequestError) as caught:
        client.completions("x", max_tokens=5000)  # beyond the context, within --max-request-output-tokens
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(NotFoundError) as missing:
        client.completions("x", model="nope")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"
    # A stream refused before it starts raises at the call, not at the first chunk.
    with pytest.raises(BadRequestError):
        client.chat_stream(MESSAGES, max_tokens=0)
    with pytest.raises(TypeError, match="extra_body"):
        client.completions("x", topk=1)  # type: ignore[call-arg]


def test_async_client(server: ServerProcess, client: Client) -> None:
    expected = client.completions([5, 6, 7], max_tokens=8, temperature=0)
    expected_chat = client.chat(MESSAGES, max_tokens=6, temperature=0)

    async def run() -> None:
        async with AsyncClient(server.base_url, max_retries=0) as aclient:
            got = await aclient.completions([5, 6, 7], max_tokens=8, temperature=0)
            assert got.choices[0].text == expected.choices[0].text and got.usage == expected.usage
            stream = await aclient.chat_stream(MESSAGES, max_tokens=6, temperature=0)
            text = "".join([c.choices[0].delta.content or "" async for c in stream])
            assert text == expected_chat.choices[0].message.content
            assert await aclient.health() is True
            with pytest.raises(BadRequestError):
                await aclient.chat(MESSAGES, max_tokens=0)

    asyncio.run(run())


# Without a server: httpx.MockTransport answers, and waits are recorded, not slept.

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
