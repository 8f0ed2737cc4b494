"""Tool-call outputs written in each model's own format, and a parse that checks every delta.

Shared by the parser tests and the auto-grammar tests: what a grammar lets through must
read back as calls.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from cadence.server.tool_parsers import ParsedDelta, ToolSpec, get_tool_parser

TOOLS = [
    ToolSpec(
        "get_weather",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    ),
    ToolSpec(
        "search",
        {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "filters": {"type": "object", "properties": {"year": {"type": "array", "items": {"type": "integer"}}}},
            },
            "required": ["query"],
        },
    ),
    ToolSpec("get_time", {}),
]


@dataclass
class Recorded:
    id: str
    parser: str
    text: str
    content: str
    calls: list[tuple[str, str]]  # name and the arguments' JSON text, as joined from the deltas
    unfinished: list[int] = field(default_factory=list)


RECORDED = [
    # hermes: Qwen2.5 / Qwen3 / Hermes write the tags as text, a newline inside each.
    Recorded(
        "hermes-two-calls-after-text",
        "hermes",
        "I'll check the weather in both cities.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "São Paulo", "unit": "celsius"}}\n</tool_call>',
        "I'll check the weather in both cities.\n\n",
        [
            ("get_weather", '{"city": "Paris", "unit": "celsius"}'),
            ("get_weather", '{"city": "São Paulo", "unit": "celsius"}'),
        ],
    ),
    Recorded(
        "hermes-nested-unicode-escapes",
        "hermes",
        "<tool_call>\n"
        '{"name": "search", "arguments": {"query": "\\"dark matter\\" 暗物质 🌌 caf\\u00e9\\\\", '
        '"filters": {"year": [2019, 2024], "peer_reviewed": true, "min_score": 4.5e-1, "tag": null}}}\n'
        "</tool_call>\nThat should find it.",
        "\nThat should find it.",
        [
            (
                "search",
                '{"query": "\\"dark matter\\" 暗物质 🌌 caf\\u00e9\\\\", '
                '"filters": {"year": [2019, 2024], "peer_reviewed": true, "min_score": 4.5e-1, "tag": null}}',
            )
        ],
    ),
    Recorded(
        "hermes-arguments-as-json-string",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>',
        "",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    Recorded(
        "hermes-name-after-arguments",
        "hermes",
        'Sure!<tool_call>{"arguments": {"city": "Rome"}, "name": "get_weather"}</tool_call>',
        "Sure!",
        [("get_weather", '{"city": "Rome"}')],
    ),
    Recorded(
        "hermes-no-arguments-and-no-closing-tag",
        "hermes",
        '<tool_call>\n{"name": "get_time"}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}',
        "\n",
        [("get_time", "{}"), ("get_time", "{}")],
    ),
    Recorded(
        "hermes-unknown-tool-is-content",
        "hermes",
        'Let me try.<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>',
        'Let me try.<tool_call>\n{"name": "send_email", "arguments": {"to": "a@b.c"}}\n</tool_call>',
        [],
    ),
    Recorded(
        "hermes-malformed-before-the-name-is-content",
        "hermes",
        '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call> ok',
        '<tool_call>\n{"name": get_weather, "arguments": {"city": "Paris"}}\n</tool_call> ok',
        [],
    ),
    Recorded(
        "hermes-arguments-not-an-object-is-content",
        "hermes",
        '<tool_call>{"name": "get_weather", "arguments": ["Paris"]}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": ["Paris"]}</tool_call>',
        [],
    ),
    Recorded(
        "hermes-broken-after-commit-ends-the-call",
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"</tool_call>\nSorry, retrying.',
        "</tool_call>\nSorry, retrying.",
        [("get_weather", '{"city": "Paris"')],
        unfinished=[0],
    ),
    Recorded(
        "hermes-truncated-mid-escape",
        "hermes",
        'Checking.<tool_call>\n{"name": "search", "arguments": {"query": "caf\\u00e',
        "Checking.",
        [("search", '{"query": "caf')],
        unfinished=[0],
    ),
    Recorded(
        "hermes-truncated-before-the-name-is-content",
        "hermes",
        'Checking.<tool_call>\n{"name": "sea',
        'Checking.<tool_call>\n{"name": "sea',
        [],
    ),
    Recorded(
        "hermes-tags-in-prose",
        "hermes",
        "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>. Done <tool_",
        "Wrap calls in <tool_call> tags, like <tool_call>this</tool_call>. Done <tool_",
        [],
    ),
    Recorded(
        "hermes-second-opening-tag-restarts",
        "hermes",
        '<tool_call> <tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
        "<tool_call> ",
        [("get_time", "{}")],
    ),
    Recorded(
        "hermes-misspelt-closing-tag-is-content",
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {}}\n</tool_cal> <tool_call>{"name": "get_time"}</tool_call>',
        "\n</tool_cal> ",
        [("get_time", "{}"), ("get_time", "{}")],
    ),
    # llama3_json: Llama 3.1/3.2 answer with the calls alone, `parameters` for the arguments.
    Recorded(
        "llama-one-call",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
        "",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    Recorded(
        "llama-python-tag-two-calls",
        "llama3_json",
        '<|python_tag|>{"name": "search", "parameters": {"query": "llama \\"3.1\\" ñ", "filters": {"year": [2024]}}}; '
        '{"name": "get_time", "parameters": {}}',
        "",
        [("search", '{"query": "llama \\"3.1\\" ñ", "filters": {"year": [2024]}}'), ("get_time", "{}")],
    ),
    Recorded(
        "llama-calls-on-lines-then-text",
        "llama3_json",
        ' {"name": "get_weather", "parameters": {"city": "Paris"}}\n'
        '{"name": "get_weather", "arguments": {"city": "Lyon"}} Both requested.',
        " Both requested.",
        [("get_weather", '{"city": "Paris"}'), ("get_weather", '{"city": "Lyon"}')],
    ),
    Recorded(
        "llama-plain-answer",
        "llama3_json",
        'It is sunny in Paris, 24°C. {"name": "get_time", "parameters": {}}',
        'It is sunny in Paris, 24°C. {"name": "get_time", "parameters": {}}',
        [],
    ),
    Recorded(
        "llama-json-answer-is-content",
        "llama3_json",
        '{"answer": 42, "unit": "m"}',
        '{"answer": 42, "unit": "m"}',
        [],
    ),
    Recorded(
        "llama-unknown-tool-is-content",
        "llama3_json",
        '{"name": "book_flight", "parameters": {"to": "NYC"}}',
        '{"name": "book_flight", "parameters": {"to": "NYC"}}',
        [],
    ),
    Recorded(
        "llama-truncated",
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Par',
        "",
        [("get_weather", '{"city": "Par')],
        unfinished=[0],
    ),
    Recorded(
        "llama-separator-then-text",
        "llama3_json",
        '{"name": "get_time", "parameters": {}}; thanks',
        "; thanks",
        [("get_time", "{}")],
    ),
    # mistral: the list form (tokenizer v3) and the named form (v11+), after [TOOL_CALLS].
    Recorded(
        "mistral-list-form",
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")],
    ),
    Recorded(
        "mistral-named-form-after-text",
        "mistral",
        'Let me look that up. [TOOL_CALLS]search[ARGS]{"query": "mistral \\"small\\" 3.2 — é", '
        '"filters": {"year": [2025]}}[TOOL_CALLS]get_time[ARGS]{}',
        "Let me look that up. ",
        [("search", '{"query": "mistral \\"small\\" 3.2 — é", "filters": {"year": [2025]}}'), ("get_time", "{}")],
    ),
    Recorded(
        "mistral-unknown-named-tool-is-content",
        "mistral",
        "[TOOL_CALLS]delete_everything[ARGS]{}",
        "[TOOL_CALLS]delete_everything[ARGS]{}",
        [],
    ),
    Recorded(
        "mistral-unknown-second-list-item",
        "mistral",
        '[TOOL_CALLS][{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}]',
        ', {"name": "nope", "arguments": {}}]',
        [("get_time", "{}")],
    ),
    Recorded(
        "mistral-truncated-named-form",
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Ber',
        "",
        [("get_weather", '{"city": "Ber')],
        unfinished=[0],
    ),
    Recorded(
        "mistral-list-form-with-spaces",
        "mistral",
        '[TOOL_CALLS] [ {"name": "get_weather", "arguments": {"city": "Nice"}} ,{"name": "get_time"} ]\nDone.',
        "\nDone.",
        [("get_weather", '{"city": "Nice"}'), ("get_time", "{}")],
    ),
    Recorded(
        "mistral-broken-args-marker-is-read-again",
        "mistral",
        "[TOOL_CALLS]get_time[AR[TOOL_CALLS]get_time[ARGS]{}",
        "[TOOL_CALLS]get_time[AR",
        [("get_time", "{}")],
    ),
    Recorded(
        "mistral-named-form-with-call-ids",
        "mistral",
        '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[CALL_ID]x[ARGS]{}',
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    Recorded(
        "mistral-bad-call-id-is-content",
        "mistral",
        "[TOOL_CALLS]get_time[CALL_ID]a-1[ARGS]{}",
        "[TOOL_CALLS]get_time[CALL_ID]a-1[ARGS]{}",
        [],
    ),
    Recorded(
        "mistral-plain-text-with-brackets",
        "mistral",
        "Use [TOOL_CALLS] and [ARGS] markers [TOOL_",
        "Use [TOOL_CALLS] and [ARGS] markers [TOOL_",
        [],
    ),
]

# The end of a text that stops inside an escape sequence of a JSON string.
OPEN_ESCAPE = re.compile(r"(?<!\\)(\\\\)*\\(u[0-9a-fA-F]{0,3})?$")


@dataclass
class Parsed:
    content: str
    calls: list[tuple[str, str]]
    unfinished: list[int]


def parse(parser_name: str, chunks: list[str]) -> Parsed:
    """Feed the chunks, check every delta's promises, and join what came out."""
    parser = get_tool_parser(parser_name)(TOOLS)
    deltas: list[ParsedDelta] = [parser.feed(chunk) for chunk in chunks]
    deltas.append(parser.finish())
    content = ""
    calls: list[list[str]] = []
    for delta in deltas:
        content += delta.content
        for call in delta.calls:
            if call.index == len(calls):
                assert call.name is not None, "a call's first delta carries its name"
                assert call.name in {tool.name for tool in TOOLS}
                calls.append([call.name, ""])
            else:
                assert call.index == len(calls) - 1, "calls arrive in order, one at a time"
                assert call.name is None, "the name is sent once"
            calls[call.index][1] += call.arguments
            assert not OPEN_ESCAPE.search(calls[call.index][1]), "a fragment stopped inside an escape"
    return Parsed(content, [(name, arguments) for name, arguments in calls], parser.unfinished_calls)


def expected(recorded: Recorded) -> Parsed:
    return Parsed(recorded.content, recorded.calls, recorded.unfinished)
