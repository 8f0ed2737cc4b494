"""Tool calling through the openai SDK against a live `cadence serve` on a tiny random
model with a tool-aware chat template (--chat-template) and the hermes parser.

`required` and named choices are forced by the grammar, so even random weights make
calls valid against the tools' schemas; `auto` cannot make a random model call a tool,
so it is checked for plumbing here and for parsing in tests/unit/test_chat_output.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, Literal

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam, ChatCompletionToolParam
from pydantic import BaseModel, Field

from tests.support.server_checks import CHAT, MESSAGES, MODEL, assert_error, post
from tests.support.server_harness import ServerProcess
from tests.support.tool_chat_template import TOOL_CHAT_TEMPLATE


class WeatherArgs(BaseModel):
    city: str = Field(max_length=10)
    unit: Literal["c", "f"]


class SearchArgs(BaseModel):
    query: str = Field(max_length=12)
    limit: int = Field(ge=1, le=5)


ARGUMENTS: dict[str, type[BaseModel]] = {"get_weather": WeatherArgs, "search": SearchArgs}
# Small hand-written schemas: the tiny model's context is 512 tokens of a tiny vocabulary.
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["c", "f"]}},
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
    "search": {
        "type": "object",
        "properties": {
            "query": {"type": "string", "maxLength": 12},
            "limit": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["query", "limit"],
        "additionalProperties": False,
    },
}
TOOLS: list[ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in SCHEMAS.items()
]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "tools.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    args = ["--num-gpu-blocks", "512", "--served-model-name", MODEL, "--chat-template", str(template)]
    args += ["--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with ServerProcess(tiny_model_dir("llama"), *args) as process:
        yield process


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def check_calls(calls: list[tuple[str, str]], max_calls: int | None = None) -> None:
    """Each call names a tool and its arguments are valid against that tool's schema."""
    assert calls
    if max_calls is not None:
        assert len(calls) <= max_calls
    for name, arguments in calls:
        ARGUMENTS[name].model_validate_json(arguments)


def message_calls(response: ChatCompletion) -> list[tuple[str, str]]:
    (choice,) = response.choices
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = choice.message.tool_calls or []
    assert len({c.id for c in calls}) == len(calls) and all(c.id.startswith("call_") for c in calls)
    return [(c.function.name, c.function.arguments) for c in calls if c.type == "function"]


@pytest.mark.parametrize("parallel", [True, False])
def test_required_makes_valid_calls(client: openai.OpenAI, parallel: bool) -> None:
    for seed in range(3):
        response = client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=parallel,
            max_tokens=200,
            seed=seed,
        )
        check_calls(message_calls(response), None if parallel else 1)


def test_named_choice_calls_that_function(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        max_tokens=120,
        seed=1,
        tool_choice={"type": "function", "function": {"name": "search"}},
    )
    calls = message_calls(response)
    assert [name for name, _ in calls] == ["search"]
    check_calls(calls)


def streamed_choices(server: ServerProcess, body: dict[str, Any]) -> dict[int, list[tuple[str, str]]]:
    """Each choice's calls assembled from a stream's deltas, checking each chunk on the way."""
    with httpx.stream("POST", f"{server.base_url}{CHAT}", json={**body, "stream": True}, timeout=60) as response:
        assert response.status_code == 200
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]" and payloads.count("[DONE]") == 1
    names: dict[tuple[int, int], str] = {}
    arguments: dict[tuple[int, int], str] = {}
    ids: set[str] = set()
    finishes: dict[int, list[str]] = {}
    for payload in payloads[:-1]:
        chunk = ChatCompletionChunk.model_validate_json(payload)
        raw = json.loads(payload)
        for choice, raw_choice in zip(chunk.choices, raw["choices"]):
            if choice.finish_reason is not None:
                finishes.setdefault(choice.index, []).append(choice.finish_reason)
            raw_calls = raw_choice["delta"].get("tool_calls", [])
            assert len({raw_call["index"] for raw_call in raw_calls}) == len(raw_calls)  # one entry per call
            for call, raw_call in zip(choice.delta.tool_calls or [], raw_calls):
                key = (choice.index, call.index)
                if key not in names:
                    # A call's first delta: index, id, type and name, with the arguments so far.
                    assert call.id and call.type == "function" and call.function and call.function.name
                    assert call.id not in ids
                    ids.add(call.id)
                    names[key] = call.function.name
                    arguments[key] = ""
                else:
                    assert set(raw_call) == {"index", "function"} and set(raw_call["function"]) == {"arguments"}
                arguments[key] += raw_call["function"]["arguments"]
    assert all(reasons == ["tool_calls"] for reasons in finishes.values())
    choices: dict[int, list[tuple[str, str]]] = {index: [] for index in finishes}
    for key in sorted(names):
        choices[key[0]].append((names[key], arguments[key]))
    return choices


def streamed_calls(server: ServerProcess, body: dict[str, Any]) -> list[tuple[str, str]]:
    (calls,) = streamed_choices(server, body).values()
    return calls


def test_streamed_required_calls_assemble_into_valid_calls(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "tool_choice": "required",
        "max_tokens": 200,
        "seed": 4,
    }
    calls = streamed_calls(server, body)
    check_calls(calls)
    unstreamed = post(server, CHAT, body).json()["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in unstreamed] == calls


def test_each_of_n_streamed_choices_has_its_own_calls(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "n": 3}
    choices = streamed_choices(server, {**body, "max_tokens": 200, "seed": 6, "parallel_tool_calls": False})
    assert sorted(choices) == [0, 1, 2]
    for calls in choices.values():
        check_calls(calls, 1)


def test_streamed_named_call(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "tools": TOOLS,
        "max_tokens": 120,
        "seed": 5,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    calls = streamed_calls(server, body)
    assert [name for name, _ in calls] == ["get_weather"]
    check_calls(calls)


def test_auto_answers_a_valid_completion(client: openai.OpenAI) -> None:
    # A random model does not call tools; the answer still validates, and a call it made
    # would be parsed (tests/unit/test_chat_output.py).
    for stream in (False, True):
        if stream:
            chunks = list(
                client.chat.completions.create(
                    model=MODEL, messages=MESSAGES, tools=TOOLS, max_tokens=16, seed=2, stream=True
                )
            )
            assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 1
        else:
            response = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=16, seed=2
            )
            assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_leaves_text(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, tools=TOOLS, tool_choice="none", max_tokens=8, seed=3
    )
    (choice,) = response.choices
    assert choice.message.tool_calls is None and isinstance(choice.message.content, str)


def tool(name: str | None = "f", **function: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"parameters": {"type": "object"}, **function}
    if name is not None:
        spec["name"] = name
    return {"type": "function", "function": spec}


BAD_TOOL_REQUESTS = [
    (
        "unknown-function",
        {"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
    ),
    ("tool-without-name", {"tools": [tool(None)]}, "tools.0.function.name"),
    ("tool-with-empty-name", {"tools": [tool("")], "tool_choice": "required"}, "tools.0.function.name"),
    ("duplicate-names", {"tools": [tool(), tool()]}, "tools"),
    ("choice-without-tools", {"tool_choice": "required"}, "tool_choice"),
    ("bad-choice", {"tools": [tool()], "tool_choice": "sometimes"}, "tool_choice"),
    (
        "response-format-with-forced-call",
        {"tools": [tool()], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
    (
        "guided-with-named-call",
        {"tools": [tool()], "tool_choice": {"type": "function", "function": {"name": "f"}}, "guided_regex": "a"},
        "guided_regex",
    ),
    ("bad-parameters-schema", {"tools": [tool(parameters={"type": "objekt"})], "tool_choice": "required"}, "tools"),
]


@pytest.mark.parametrize(
    "fields,param", [(f, p) for _, f, p in BAD_TOOL_REQUESTS], ids=[i for i, _, _ in BAD_TOOL_REQUESTS]
)
def test_bad_tool_requests_are_400s(server: ServerProcess, fields: dict[str, Any], param: str) -> None:
    assert_error(post(server, CHAT, {"model": MODEL, "messages": MESSAGES, **fields}), 400, param=param)


MULTI_TURN: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
]


def test_multi_turn_renders_through_the_template(server: ServerProcess) -> None:
    # Arguments as JSON text and as an object render the same (templates read an object).
    as_object = json.loads(json.dumps(MULTI_TURN))
    as_object[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "c"}
    tools = [TOOLS[0]]
    expected = (
        "<|im_start|>system\nTools:\nget_weather\n<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call><|im_end|>\n'
        '<|im_start|>user\n<tool_response id="call_1">\n18 C\n</tool_response><|im_end|>\n'
        "<|im_start|>assistant\n"
    )
    for messages in (MULTI_TURN, as_object):
        tokens = post(server, "/tokenize", {"model": MODEL, "messages": messages, "tools": tools}).json()["tokens"]
        assert post(server, "/detokenize", {"model": MODEL, "tokens": tokens}).json()["prompt"] == expected


def test_multi_turn_chat_is_served(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MULTI_TURN, tools=TOOLS, tool_choice="none", max_tokens=4
    )
    assert response.choices[0].finish_reason in ("stop", "length")


def test_template_kwargs_reach_the_template(server: ServerProcess) -> None:
    def rendered(kwargs: dict[str, Any] | None) -> str:
        body: dict[str, Any] = {"model": MODEL, "messages": MESSAGES}
        if kwargs is not None:
            body["chat_template_kwargs"] = kwargs
        tokens = post(server, "/tokenize", body).json()["tokens"]
        return post(server, "/detokenize", {"model": MODEL, "tokens": tokens}).json()["prompt"]

    assert rendered({"enable_thinking": True}) == rendered(None) + "<think>\n"
    assert rendered({"enable_thinking": False}) == rendered(None) + "<think>\n\n</think>\n\n"
