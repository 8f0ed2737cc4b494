"""cadence.client against a live `cadence serve` on a tiny random model, compared with the
openai SDK on the same requests (its transport alone: tests/unit/test_client_transport.py)."""

from __future__ import annotations

import asyncio
import json
import os
import random
from collections.abc import Callable, Iterator
from typing import Any, cast

import openai
import pytest

from cadence.client import (
    AsyncClient,
    BadRequestError,
    ChatMessage,
    Client,
    NotFoundError,
    metric_value,
)
from cadence.client.params import ToolCall
from cadence.openai_schema.responses import (
    CompletionStreamResponse,
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
