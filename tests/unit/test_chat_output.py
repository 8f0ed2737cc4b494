"""Chat output assembly: generated text -> message and stream deltas, through the real
tool-call and reasoning parsers and the forced-call readers, whole and cut at every
character boundary (the two must agree)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from openai.types.chat import ChatCompletionChunk, ChatCompletionMessage, ChatCompletionMessageFunctionToolCall
from openai.types.chat.chat_completion_chunk import ChoiceDelta
from transformers import AutoTokenizer

from cadence.openai_schema.constraint_fields import Tool
from cadence.server.chat_output import ChoiceReader, OutputReading, finish_reason
from cadence.server.reasoning import get_reasoning_parser
from cadence.server.tool_calls import ToolPlan
from cadence.server.tool_parsers import get_tool_parser
from tests.support.tiny_tokenizer import save_tiny_tokenizer

TOOLS = tuple(
    Tool.model_validate({"type": "function", "function": {"name": name, "parameters": {"type": "object"}}})
    for name in ("get_weather", "search")
)


def reading(
    mode: str,
    tool_parser: str | None = None,
    reasoning: str | None = None,
    open_: bool = False,
    named: str | None = None,
) -> OutputReading:
    return OutputReading(
        ToolPlan(mode, TOOLS, named),  # type: ignore[arg-type]
        None if tool_parser is None else get_tool_parser(tool_parser),
        None if reasoning is None else get_reasoning_parser(reasoning),
        open_,
    )


def whole(read: OutputReading, text: str) -> tuple[ChoiceReader, ChatCompletionMessage]:
    reader = read.reader()
    reader.feed(text)
    reader.finish()
    message = reader.message()
    return reader, ChatCompletionMessage.model_validate(message.model_dump())


def streamed(read: OutputReading, pieces: list[str]) -> dict[str, Any]:
    """The message the SDK would assemble from the deltas of `pieces`, checking each delta."""
    reader = read.reader()
    content, reasoning = "", ""
    calls: dict[int, dict[str, str]] = {}
    for i, piece in enumerate(pieces + [""]):
        last = i == len(pieces)
        out = reader.feed(piece) if not last else reader.finish()
        delta = reader.delta(out, first=i == 0)
        raw = delta.model_dump(exclude_unset=True)
        ChoiceDelta.model_validate(raw)
        content += raw.get("content") or ""
        reasoning += raw.get("reasoning_content") or ""
        entries = raw.get("tool_calls", [])
        assert len({call["index"] for call in entries}) == len(entries)  # one entry per call per chunk
        ChatCompletionChunk.model_validate(
            {
                "id": "c",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": "m",
                "choices": [{"index": 0, "delta": raw, "finish_reason": None}],
            }
        )
        for call in entries:
            if call["index"] not in calls:
                assert set(call) == {"index", "id", "type", "function"}
                calls[call["index"]] = {"id": call["id"], "name": call["function"]["name"], "arguments": ""}
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            calls[call["index"]]["arguments"] += call["function"]["arguments"]
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}


def splits(text: str) -> list[list[str]]:
    """The text whole, one character at a time, and cut in two at every boundary."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


def function_calls(message: ChatCompletionMessage) -> list[tuple[str, str]]:
    calls = message.tool_calls or []
    assert all(isinstance(c, ChatCompletionMessageFunctionToolCall) for c in calls)
    return [
        (c.function.name, c.function.arguments) for c in calls if isinstance(c, ChatCompletionMessageFunctionToolCall)
    ]


def check_agrees(read: OutputReading, text: str) -> ChatCompletionMessage:
    reader, message = whole(read, text)
    expected_calls = function_calls(message)
    for pieces in splits(text):
        got = streamed(read, pieces)
        assert got["content"] == (message.content or "")
        assert got["reasoning"] == (getattr(message, "reasoning_content", None) or "")
        assert [(c["name"], c["arguments"]) for c in got["calls"]] == expected_calls
    return message


HERMES_TEXT = (
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "search", "arguments": {"q": "rain"}}\n</tool_call>'
)


def test_hermes_calls_become_tool_calls() -> None:
    reader, message = whole(reading("auto", "hermes"), HERMES_TEXT)
    assert message.content == "Let me look. \n"  # the text between the calls is content too
    assert [(name, json.loads(arguments)) for name, arguments in function_calls(message)] == [
        ("get_weather", {"city": "Paris"}),
        ("search", {"q": "rain"}),
    ]
    ids = [c.id for c in message.tool_calls or []]
    assert len(set(ids)) == 2 and all(i.startswith("call_") for i in ids)
    assert finish_reason("stop", reader) == "tool_calls"
    assert finish_reason("length", reader) == "length"
    check_agrees(reading("auto", "hermes"), HERMES_TEXT)


def test_only_calls_means_content_null() -> None:
    text = '<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>'
    _, message = whole(reading("auto", "hermes"), text)
    assert message.content is None and message.tool_calls


def test_no_call_is_plain_content() -> None:
    reader, message = whole(reading("auto", "hermes"), "Just words, <b>and</b> a tag.")
    assert message.content == "Just words, <b>and</b> a tag." and message.tool_calls is None
    assert finish_reason("stop", reader) == "stop"


def test_tool_choice_none_reads_no_calls() -> None:
    _, message = whole(reading("none", "hermes"), HERMES_TEXT)
    assert message.content == HERMES_TEXT and message.tool_calls is None


@pytest.mark.parametrize(
    "reasoning,open_,text",
    [
        ("qwen3", False, "<think>Paris? Check.</think>\n\n" + HERMES_TEXT),
        ("deepseek_r1", True, "Paris? Check.</think>\n\n" + HERMES_TEXT),
    ],
)
def test_reasoning_then_calls(reasoning: str, open_: bool, text: str) -> None:
    message = check_agrees(reading("auto", "hermes", reasoning, open_), text)
    assert message.model_extra is not None and message.model_extra["reasoning_content"] == "Paris? Check."
    assert (message.content or "").strip() == "Let me look."
    assert [name for name, _ in function_calls(message)] == ["get_weather", "search"]


def test_reasoning_without_tools() -> None:
    message = check_agrees(reading("none", None, "qwen3"), "<think>a</think>b")
    assert message.content == "b" and message.model_extra and message.model_extra["reasoning_content"] == "a"


REQUIRED_TEXT = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "n": [1, {"x": "]}"}]}}, '
    '{"parameters": 5, "name": "search"}]'
)


def test_required_calls() -> None:
    reader, message = whole(reading("required"), REQUIRED_TEXT)
    assert message.content is None
    assert [(name, json.loads(arguments)) for name, arguments in function_calls(message)] == [
        ("get_weather", {"city": "Paris", "n": [1, {"x": "]}"}]}),
        ("search", 5),
    ]
    assert finish_reason("stop", reader) == "tool_calls"
    check_agrees(reading("required"), REQUIRED_TEXT)


def test_named_call() -> None:
    text = '{"city": "Paris", "unit": "c"}'
    _, message = whole(reading("named", named="get_weather"), text)
    assert function_calls(message) == [("get_weather", text)]
    check_agrees(reading("named", named="get_weather"), text)


def test_each_choice_reads_on_its_own() -> None:
    read = reading("auto", "hermes")
    first, second = read.reader(), read.reader()
    first.feed('<tool_call>\n{"name": "search", "arguments": {}}\n</tool_call>')
    second.feed("plain")
    first.finish()
    second.finish()
    assert first.made_calls and not second.made_calls


def test_forced_call_after_reasoning() -> None:
    read = reading("named", None, "deepseek_r1", True, named="get_weather")
    message = check_agrees(read, 'Paris.</think>\n\n{"city": "Paris"}')
    assert function_calls(message) == [("get_weather", '{"city": "Paris"}')]
    assert message.model_extra is not None and message.model_extra["reasoning_content"] == "Paris."


def test_mistral_calls_are_decoded_with_their_special_marker(tmp_path: Path) -> None:
    save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    ids = tokenizer.encode('Sure. [TOOL_CALLS][{"name": "search", "arguments": {"q": "x"}}]', add_special_tokens=False)
    mistral = reading("auto", "mistral")
    skip = mistral.skip_special_tokens(requested=True)
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    assert isinstance(text, str)
    _, message = whole(mistral, text)
    assert function_calls(message) == [("search", '{"q": "x"}')]
    assert message.content == "Sure. "
    # Other parsers, and forced calls, decode as the request asks.
    assert reading("auto", "hermes").skip_special_tokens(requested=True)
    assert reading("named", "mistral", named="search").skip_special_tokens(requested=True)
    assert not reading("auto", "hermes").skip_special_tokens(requested=False)


@pytest.mark.parametrize(
    ("read", "cut"),
    [
        (reading("auto", "hermes"), '<tool_call>\n{"name": "search", "arguments": {"q": "ra'),
        (reading("auto", "mistral"), '[TOOL_CALLS][{"name": "search", "arguments": {"q": '),
        (reading("required"), '[{"name": "search", "parameters": {"q": "ra'),
        (reading("required"), '[{"name": "search", "parameters": {"q": "x"}}, {"name": "get_weather", '),
        (reading("named", named="search"), '{"q": "ra'),
        (reading("named", named="search"), '{"q": 12'),
    ],
)
def test_a_call_cut_short_keeps_finish_reason_stop(read: OutputReading, cut: str) -> None:
    # A stop string or the stop token inside a call's arguments: nothing a client can run.
    reader, message = whole(read, cut)
    assert message.tool_calls
    assert finish_reason("stop", reader) == "stop"
    assert finish_reason("length", reader) == "length"


@pytest.mark.parametrize(
    ("read", "text"),
    [
        (reading("named", named="search"), '{"q": 12}'),
        (reading("named", named="search"), "12"),
        (reading("required"), '[{"parameters": {"q": 1}, "name": "search"}]'),
        (reading("auto", "mistral"), '[TOOL_CALLS][{"name": "search", "arguments": {"q": 1}}]'),
    ],
)
def test_whole_calls_finish_with_tool_calls(read: OutputReading, text: str) -> None:
    reader, _ = whole(read, text)
    assert finish_reason("stop", reader) == "tool_calls"


def test_parallel_tool_calls_false_keeps_the_first_auto_call() -> None:
    read = OutputReading(ToolPlan("auto", TOOLS, parallel_calls=False), get_tool_parser("hermes"))
    cut = HERMES_TEXT + '<tool_call>\n{"name": "search", "arguments": {"q": "sn'
    reader, message = whole(read, cut)
    assert function_calls(message) == [("get_weather", '{"city": "Paris"}')]
    assert message.content == "Let me look. \n"
    assert finish_reason("stop", reader) == "tool_calls"  # the dropped call's cut does not count
    check_agrees(read, cut)
