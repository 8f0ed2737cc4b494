"""Tool-call parsers on outputs written in each model's own format, whole and cut anywhere.

Every recorded output is parsed whole, then streamed cut at every character boundary,
one character at a time and in random chunks: the content and the calls must come out
the same, and every streamed delta must keep the parsers' promises (a call's name once,
on its first delta; arguments that join into JSON and never stop inside an escape).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import llguidance
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.server.tool_parsers import TOOL_PARSERS, ParsedDelta, ToolSpec, get_tool_parser
from cadence.server.tool_parsers.json_prefix import JsonPrefixScanner
from cadence.structured_outputs.grammar import check_grammar, grammar_text, ll_tokenizer, parser_limits
from cadence.structured_outputs.params import StructuredOutputsParams
from tests.support.tiny_tokenizer import save_tiny_tokenizer

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
        "mistral-plain-text-with-brackets",
        "mistral",
        "Use [TOOL_CALLS] and [ARGS] markers [TOOL_",
        "Use [TOOL_CALLS] and [ARGS] markers [TOOL_",
        [],
    ),
]

# The end of a text that stops inside an escape sequence of a JSON string.
_OPEN_ESCAPE = re.compile(r"(?<!\\)(\\\\)*\\(u[0-9a-fA-F]{0,3})?$")


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
            assert not _OPEN_ESCAPE.search(calls[call.index][1]), "a fragment stopped inside an escape"
    return Parsed(content, [(name, arguments) for name, arguments in calls], parser.unfinished_calls)


def expected(recorded: Recorded) -> Parsed:
    return Parsed(recorded.content, recorded.calls, recorded.unfinished)


@pytest.mark.parametrize("recorded", RECORDED, ids=[recorded.id for recorded in RECORDED])
def test_whole_output(recorded: Recorded) -> None:
    parsed = parse(recorded.parser, [recorded.text])
    assert parsed == expected(recorded)
    for index, (_, arguments) in enumerate(parsed.calls):
        if index not in recorded.unfinished:
            assert isinstance(json.loads(arguments), dict)


@pytest.mark.parametrize("recorded", RECORDED, ids=[recorded.id for recorded in RECORDED])
def test_cut_at_every_boundary(recorded: Recorded) -> None:
    text = recorded.text
    for cut in range(len(text) + 1):
        assert parse(recorded.parser, [text[:cut], text[cut:]]) == expected(recorded), f"cut at {cut}"
    assert parse(recorded.parser, list(text)) == expected(recorded)


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_random_chunks(data: st.DataObject) -> None:
    recorded = data.draw(st.sampled_from(RECORDED))
    text = recorded.text
    cuts = sorted(data.draw(st.sets(st.integers(0, len(text)), max_size=12)))
    chunks = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(recorded.parser, chunks) == expected(recorded)


def test_arguments_stream_while_the_call_is_written() -> None:
    parser = get_tool_parser("hermes")(TOOLS)
    assert parser.feed("Hi <tool_") == ParsedDelta(content="Hi ")
    assert parser.feed('call>\n{"name": "search", "argu') == ParsedDelta()
    first = parser.feed('ments": {"query": "tea\\')
    assert (first.content, [(c.index, c.name, c.arguments) for c in first.calls]) == (
        "",
        [(0, "search", '{"query": "tea')],
    )
    second = parser.feed('"s"}}\n</tool_call>')
    assert [(c.index, c.name, c.arguments) for c in second.calls] == [(0, None, '\\"s"}')]
    assert parser.finish() == ParsedDelta()


def test_held_tag_prefix_is_released_once_it_cannot_be_a_tag() -> None:
    parser = get_tool_parser("hermes")(TOOLS)
    assert parser.feed("a <tool") == ParsedDelta(content="a ")
    assert parser.feed("s and more <") == ParsedDelta(content="<tools and more ")
    assert parser.feed("b>") == ParsedDelta(content="<b>")


def test_unknown_name_is_released_as_soon_as_it_is_complete() -> None:
    parser = get_tool_parser("hermes")(TOOLS)
    assert parser.feed('<tool_call>{"name": "get_wea') == ParsedDelta()
    assert parser.feed('ther_now", ') == ParsedDelta(content='<tool_call>{"name": "get_weather_now", ')


def test_registry() -> None:
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral"}
    with pytest.raises(ValueError, match="hermes"):
        get_tool_parser("nope")


def _json_values() -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=6)
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    )


@settings(max_examples=300, deadline=None)
@given(value=_json_values(), ascii_only=st.booleans(), indent=st.sampled_from([None, 0, 2]))
def test_scanner_accepts_every_prefix_of_valid_json(value: Any, ascii_only: bool, indent: int | None) -> None:
    text = json.dumps({"v": value}, ensure_ascii=ascii_only, indent=indent)
    scanner = JsonPrefixScanner()
    for position, char in enumerate(text):
        assert scanner.push(char), f"refused {char!r} at {position} of {text!r}"
        assert not _OPEN_ESCAPE.search(text[: scanner.safe_length])
        assert scanner.done == (position == len(text) - 1)


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet='{}[]",:\\ 0123456789.eE+-tfnrulasu', max_size=14))
def test_scanner_agrees_with_json_on_arbitrary_text(text: str) -> None:
    scanner = JsonPrefixScanner()
    accepted = all(scanner.push(char) for char in text) and scanner.finish()

    def refuse(name: str) -> None:
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=refuse)
        valid = bool(text.strip())
    except ValueError:
        valid = False
    assert accepted == valid, text


@pytest.fixture(scope="module")
def tiny_ll_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> llguidance.LLTokenizer:
    path = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(path)
    return ll_tokenizer((path / "tokenizer.json").read_text(), vocab_size=512, eos_token_ids=[2])


def _grammar_accepts(tokenizer: llguidance.LLTokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(tokenizer, grammar, limits=parser_limits(), log_level=0)
    consumed = matcher.consume_tokens(tokenizer.tokenize_str(text))
    return consumed and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize(
    ("parser_name", "text", "accepted"),
    [
        ("hermes", "No tool needed: 2 + 2 = 4.", True),
        (
            "hermes",
            'Checking.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call> Done.',
            True,
        ),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"town": "Paris"}}\n</tool_call>', False),
        ("hermes", '<tool_call>\n{"name": "send_email", "arguments": {}}\n</tool_call>', False),
        ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', False),
        ("llama3_json", "It is sunny in Paris.", True),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
            True,
        ),
        ("llama3_json", '{"answer": 42}', False),
        ("llama3_json", '{"name": "get_weather", "parameters": {"city": 7}}', False),
    ],
)
def test_auto_grammar_holds_calls_to_the_tools(
    tiny_ll_tokenizer: llguidance.LLTokenizer, parser_name: str, text: str, accepted: bool
) -> None:
    grammar = get_tool_parser(parser_name)(TOOLS).auto_grammar()
    assert grammar is not None
    check_grammar(grammar)
    check_grammar(grammar_text(StructuredOutputsParams(grammar=grammar)), tiny_ll_tokenizer)
    assert _grammar_accepts(tiny_ll_tokenizer, grammar, text) == accepted
    if accepted:  # what the grammar lets through, the parser reads as calls
        parsed = parse(parser_name, [text])
        assert all(name in {tool.name for tool in TOOLS} for name, _ in parsed.calls)
        assert "tool_call" not in parsed.content and '"name"' not in parsed.content


def test_auto_grammar_where_none_can_be_written() -> None:
    assert get_tool_parser("mistral")(TOOLS).auto_grammar() is None  # [TOOL_CALLS] is a special token
    assert get_tool_parser("hermes")([]).auto_grammar() is None
