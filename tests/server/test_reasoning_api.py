"""Reasoning through the openai SDK against a live `cadence serve --reasoning-parser qwen3`
on a tiny random model whose template opens `<think>` when asked (chat_template_kwargs).

A random model never closes its thinking, which is what these tests lean on: with the
block left open by the prompt, a constraint must wait for the end marker, so the whole
answer stays reasoning; with thinking off, the constraint binds from the first token.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk

from tests.support.server_checks import CHAT, MESSAGES, MODEL, post
from tests.support.server_harness import ServerProcess
from tests.support.tool_chat_template import TOOL_CHAT_TEMPLATE

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["n"],
    "additionalProperties": False,
}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    template = tmp_path_factory.mktemp("template") / "think.jinja"
    template.write_text(TOOL_CHAT_TEMPLATE)
    args = ["--num-gpu-blocks", "512", "--served-model-name", MODEL, "--chat-template", str(template)]
    with ServerProcess(tiny_model_dir("llama"), *args, "--reasoning-parser", "qwen3") as process:
        yield process


def answer(server: ServerProcess, **fields: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "seed": 3, **fields}
    response = post(server, CHAT, body)
    assert response.status_code == 200, response.text
    openai.types.chat.ChatCompletion.model_validate(response.json())
    return response.json()["choices"][0]


def test_open_thinking_goes_to_reasoning_content(server: ServerProcess) -> None:
    choice = answer(server, **THINKING)
    assert choice["message"]["reasoning_content"]
    assert not choice["message"]["content"]
    assert choice["finish_reason"] == "length"


def test_constraint_waits_for_the_end_of_the_reasoning(server: ServerProcess) -> None:
    # Bound from the first token, the answer would be JSON: it is still thinking instead.
    choice = answer(
        server, response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}, **THINKING
    )
    assert choice["message"]["reasoning_content"] and not choice["message"]["content"]
    assert choice["finish_reason"] == "length"


def test_without_thinking_the_constraint_binds_the_answer(server: ServerProcess) -> None:
    choice = answer(
        server,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        chat_template_kwargs={"enable_thinking": False},
    )
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["reasoning_content"] is None
    assert 0 <= json.loads(choice["message"]["content"])["n"] <= 99


def test_streamed_reasoning_matches_the_message(server: ServerProcess) -> None:
    whole = answer(server, **THINKING)["message"]
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 24, "seed": 3, "stream": True, **THINKING}
    with httpx.stream("POST", f"{server.base_url}{CHAT}", json=body, timeout=60) as response:
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate_json(p) for p in payloads[:-1]]
    raw = [json.loads(p)["choices"][0]["delta"] for p in payloads[:-1]]
    assert raw[0]["role"] == "assistant" and all("role" not in d for d in raw[1:])
    assert sum(1 for c in chunks for ch in c.choices if ch.finish_reason) == 1
    assert "".join(d.get("reasoning_content", "") for d in raw) == whole["reasoning_content"]
    assert "".join(d.get("content") or "" for d in raw) == (whole["content"] or "")
