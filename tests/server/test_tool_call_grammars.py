"""The parsers' `tool_choice: auto` grammars: free text stays free, calls keep to the tools' schemas."""

from __future__ import annotations

import llguidance
import pytest

from cadence.server.tool_parsers import ToolSpec, get_tool_parser
from cadence.structured_outputs.grammar import check_grammar, grammar_text, ll_tokenizer, parser_limits
from cadence.structured_outputs.params import StructuredOutputsParams
from tests.support.tiny_tokenizer import save_tiny_tokenizer
from tests.support.tool_call_outputs import TOOLS, parse


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


def test_auto_grammar_reads_schemas_as_named_calls_do(tiny_ll_tokenizer: llguidance.LLTokenizer) -> None:
    # pydantic writes uniqueItems for a set[str] field: tolerated alone, so in auto calls too;
    # the arguments keep grammar_text's separators and have no free whitespace.
    tags = {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": True}},
    }
    check_grammar(grammar_text(StructuredOutputsParams(json=tags)), tiny_ll_tokenizer)
    grammar = get_tool_parser("hermes")([ToolSpec("tag", tags)]).auto_grammar()
    assert grammar is not None
    check_grammar(grammar_text(StructuredOutputsParams(grammar=grammar)), tiny_ll_tokenizer)
    call = '<tool_call>\n{"name": "tag", "arguments": ARGS}\n</tool_call>'
    assert _grammar_accepts(tiny_ll_tokenizer, grammar, call.replace("ARGS", '{"tags": ["a", "b"]}'))
    assert not _grammar_accepts(tiny_ll_tokenizer, grammar, call.replace("ARGS", '{"tags":["a","b"]}'))
    assert not _grammar_accepts(tiny_ll_tokenizer, grammar, call.replace("ARGS", '{ "tags": ["a", "b"]}'))
