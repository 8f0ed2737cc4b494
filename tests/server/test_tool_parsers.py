"""Tool-call parsers on outputs written in each model's own format, whole and cut anywhere.

Every recorded output is parsed whole, then streamed cut at every character boundary,
one character at a time and in random chunks: the content and the calls must come out
the same, and every streamed delta must keep the parsers' promises (a call's name once,
on its first delta; arguments that join into JSON and never stop inside an escape).
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.server.tool_parsers import TOOL_PARSERS, ParsedDelta, get_tool_parser
from tests.support.tool_call_outputs import RECORDED, TOOLS, Recorded, expected, parse


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


@pytest.mark.parametrize(
    ("parser_name", "opening", "closing"),
    [("hermes", "<tool_call>\n", "\n</tool_call>"), ("mistral", "[TOOL_CALLS][", "]"), ("llama3_json", "", "")],
)
def test_arguments_nested_past_pythons_parser_are_content(parser_name: str, opening: str, closing: str) -> None:
    # Arguments sent as a JSON string whose text nests deeper than json.loads can go.
    key = "parameters" if parser_name == "llama3_json" else "arguments"
    nested = json.dumps("[" * 3000 + "]" * 3000)
    text = opening + '{"name": "search", "' + key + '": ' + nested + "}" + closing
    parsed = parse(parser_name, [text])
    assert parsed.calls == [] and parsed.content == text
