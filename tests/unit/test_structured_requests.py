"""Request fields -> the engine's StructuredOutputsParams, the API process's grammar check
(400s with param, the compile time limit), forced tool calls' schemas and the constraint
bound to the text after the reasoning, checked on an llguidance matcher."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import llguidance
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from cadence.openai_schema.requests import ChatCompletionRequest, CompletionRequest
from cadence.server.chat_output import OutputReading
from cadence.server.errors import APIError
from cadence.server.reasoning import get_reasoning_parser
from cadence.server.reasoning_grammar import after_reasoning
from cadence.server.serving_chat import answer_constraint
from cadence.server.structured_requests import Constraint, GrammarChecker, requested_constraint
from cadence.server.tool_calls import plan_tools
from cadence.server.tool_parsers import ToolSpec, get_tool_parser
from cadence.structured_outputs.grammar import grammar_text, ll_tokenizer
from cadence.structured_outputs.params import StructuredOutputsParams
from tests.support.tiny_tokenizer import save_tiny_tokenizer

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "fields,expected,param",
    [
        ({"response_format": {"type": "text"}}, None, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True), "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
            StructuredOutputsParams(json=SCHEMA),
            "response_format",
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json=SCHEMA), "structured_outputs"),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+"), "structured_outputs"),
        (
            {"structured_outputs": {"choice": ["x", "y"]}},
            StructuredOutputsParams(choice=("x", "y")),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"grammar": 'root ::= "a"'}},
            StructuredOutputsParams(grammar='root ::= "a"'),
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"json_object": True, "disable_any_whitespace": True}},
            StructuredOutputsParams(json_object=True),
            "structured_outputs",
        ),
        ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json=json.dumps(SCHEMA)), "guided_json"),
        ({"guided_regex": "b"}, StructuredOutputsParams(regex="b"), "guided_regex"),
        ({"guided_choice": ["z"]}, StructuredOutputsParams(choice=("z",)), "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutputsParams(grammar='root ::= "a"'), "guided_grammar"),
    ],
)
def test_each_form_maps_to_its_params(
    fields: dict[str, Any], expected: StructuredOutputsParams | None, param: str | None
) -> None:
    for body in (
        CompletionRequest.model_validate({"prompt": "x", **fields}),
        ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields}),
    ):
        constraint = requested_constraint(body)
        assert constraint == (None if expected is None else Constraint(expected, param or ""))


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PreTrainedTokenizerBase:
    path = tmp_path_factory.mktemp("tokenizer")
    save_tiny_tokenizer(path)
    return AutoTokenizer.from_pretrained(path)


def checker(tokenizer: PreTrainedTokenizerBase, timeout: float = 30.0) -> GrammarChecker:
    return GrammarChecker(tokenizer.backend_tokenizer.to_str(), 512, [2], timeout)


def check(grammars: GrammarChecker, params: StructuredOutputsParams, param: str = "guided_json") -> APIError | None:
    try:
        asyncio.run(grammars.check(Constraint(params, param)))
    except APIError as error:
        return error
    return None


def test_the_check_refuses_with_the_field_named(tokenizer: PreTrainedTokenizerBase) -> None:
    grammars = checker(tokenizer)
    assert check(grammars, StructuredOutputsParams(json=SCHEMA)) is None
    error = check(grammars, StructuredOutputsParams(json={"type": "object", "not": {}}), "response_format")
    assert error is not None and error.status == 400 and error.param == "response_format"
    assert "not" in error.message  # names the unsupported keyword
    nested: dict[str, Any] = {"type": "string"}
    for _ in range(1500):
        nested = {"type": "array", "items": nested}
    error = check(grammars, StructuredOutputsParams(json=nested))
    assert error is not None and error.param == "guided_json"
    grammars.close()


def test_a_grammar_past_the_time_limit_is_a_400(tokenizer: PreTrainedTokenizerBase) -> None:
    grammars = checker(tokenizer)
    passed = StructuredOutputsParams(json={"enum": [f"v{i}" for i in range(10_000)]})
    assert check(grammars, passed) is None
    grammars.timeout = 1e-6
    assert check(grammars, passed) is None  # passed once: not checked again
    error = check(grammars, StructuredOutputsParams(json={"enum": [f"w{i}" for i in range(10_000)]}), "guided_json")
    assert error is not None and error.status == 400 and error.param == "guided_json"
    assert "--structured-outputs-compile-timeout" in error.message
    grammars.close()


def tool_request(**fields: Any) -> ChatCompletionRequest:
    tools = [{"type": "function", "function": {"name": n, "parameters": SCHEMA}} for n in ("f", "g")]
    return ChatCompletionRequest.model_validate({"messages": MESSAGES, "tools": tools, **fields})


def matches(tokenizer: PreTrainedTokenizerBase, params: StructuredOutputsParams, text: str) -> bool:
    grammar = grammar_text(params)
    matcher = llguidance.LLMatcher(ll_tokenizer(tokenizer.backend_tokenizer.to_str(), 512, [2]), grammar)
    return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()


def test_required_and_named_schemas(tokenizer: PreTrainedTokenizerBase) -> None:
    required = plan_tools(tool_request(tool_choice="required"), auto_tool_choice=False).constraint(True)
    assert required is not None and required.param == "tools"
    assert matches(
        tokenizer, required.params, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"a": 2}}]'
    )
    assert not matches(tokenizer, required.params, "[]")
    assert not matches(tokenizer, required.params, '[{"name": "h", "parameters": {"a": 1}}]')
    single = plan_tools(tool_request(tool_choice="required", parallel_tool_calls=False), False)
    one = single.constraint(False)
    assert one is not None
    assert matches(tokenizer, one.params, '[{"name": "g", "parameters": {"a": 2}}]')
    assert not matches(
        tokenizer, one.params, '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {"a": 2}}]'
    )
    named = plan_tools(tool_request(tool_choice={"type": "function", "function": {"name": "g"}}), False).constraint(
        True
    )
    assert named is not None and matches(tokenizer, named.params, '{"a": 3}')
    assert not matches(tokenizer, named.params, '{"a": "3"}')


def test_auto_needs_the_servers_parser() -> None:
    with pytest.raises(APIError) as refused:
        plan_tools(tool_request(), auto_tool_choice=False)
    assert refused.value.param == "tool_choice"
    assert plan_tools(tool_request(), auto_tool_choice=True).mode == "auto"
    assert plan_tools(tool_request(tool_choice="none"), auto_tool_choice=False).constraint(True) is None


@pytest.mark.parametrize(
    "params,answer",
    [
        (StructuredOutputsParams(json=SCHEMA), '{"a": 5}'),
        (StructuredOutputsParams(json_object=True), '{"b": [1, 2]}'),
        (StructuredOutputsParams(regex="[0-9]+/x"), "12/x"),
        (StructuredOutputsParams(choice=("yes", "no}")), "no}"),
        (StructuredOutputsParams(grammar='root ::= "a" "b"*'), "abb"),
    ],
)
def test_constraint_after_reasoning(
    tokenizer: PreTrainedTokenizerBase, params: StructuredOutputsParams, answer: str
) -> None:
    # Left open by the prompt: free thinking up to the first end marker, then the answer.
    opened = after_reasoning(params, "</think>", None, starts_open=True)
    assert matches(tokenizer, opened, "Maybe {x} </think>\n\n" + answer)
    assert not matches(tokenizer, opened, answer)  # the thinking must end first
    assert not matches(tokenizer, opened, "a </think> b </think>" + answer)  # the first end marker ends it
    # The model may open a block itself: optional.
    optional = after_reasoning(params, "</think>", "<think>", starts_open=False)
    assert matches(tokenizer, optional, answer)
    assert matches(tokenizer, optional, "<think>hmm</think>" + answer)
    assert not matches(tokenizer, optional, "hmm</think>" + answer)
    # Neither: the constraint binds from the first token, unchanged.
    assert after_reasoning(params, "</think>", None, starts_open=False) == params


def test_the_answers_constraint_per_tool_choice_and_reasoning() -> None:
    hermes = get_tool_parser("hermes")
    auto = tool_request(tool_choice="auto")
    plain = OutputReading(plan_tools(auto, auto_tool_choice=True), hermes)
    constraint = answer_constraint(auto, plain)
    assert constraint is not None and constraint.param == "tools"
    assert constraint.params.grammar == hermes([ToolSpec("f", SCHEMA), ToolSpec("g", SCHEMA)]).auto_grammar()
    # Reasoning left open by the prompt: the same grammar, after the end marker.
    thinking = OutputReading(plain.plan, hermes, get_reasoning_parser("deepseek_r1"), starts_in_reasoning=True)
    wrapped = answer_constraint(auto, thinking)
    assert wrapped is not None and wrapped.params.grammar is not None
    assert wrapped.params.grammar.startswith("start: thinking GAP answer")
    # A request's own constraint wins over the auto grammar; none without tools or format.
    formatted = tool_request(tool_choice="auto", guided_regex="[ab]")
    assert answer_constraint(formatted, plain) == Constraint(StructuredOutputsParams(regex="[ab]"), "guided_regex")
    none = tool_request(tool_choice="none")
    assert answer_constraint(none, OutputReading(plan_tools(none, True), hermes)) is None


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"guided_json": "{bad"}, "guided_json"),
        ({"structured_outputs": {"grammar": "root ::= ???"}}, "structured_outputs"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"description": "x" * 300_000}},
                }
            },
            "response_format",
        ),
    ],
)
def test_a_bad_constraint_after_reasoning_is_a_400_naming_its_field(fields: dict[str, Any], param: str) -> None:
    body = ChatCompletionRequest.model_validate({"messages": MESSAGES, **fields})
    thinking = OutputReading(
        plan_tools(body, False), None, get_reasoning_parser("deepseek_r1"), starts_in_reasoning=True
    )
    with pytest.raises(APIError) as refused:
        answer_constraint(body, thinking)
    assert refused.value.status == 400 and refused.value.param == param


def test_forced_calls_take_objects_where_the_schema_leaves_the_type_open(tokenizer: PreTrainedTokenizerBase) -> None:
    untyped = {"properties": {"city": {"type": "string"}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": untyped}}]
    named_body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "f"}}}
    )
    named = plan_tools(named_body, False).constraint(True)
    required_body = ChatCompletionRequest.model_validate(
        {"messages": MESSAGES, "tools": tools, "tool_choice": "required"}
    )
    required = plan_tools(required_body, False).constraint(True)
    assert named is not None and required is not None
    assert matches(tokenizer, named.params, '{"city": "Paris"}')
    for arguments in ("42", '"Paris"', "[1, 2]"):
        assert not matches(tokenizer, named.params, arguments)
        assert not matches(tokenizer, required.params, '[{"name": "f", "parameters": ' + arguments + "}]")
    assert matches(tokenizer, required.params, '[{"name": "f", "parameters": {"city": "Paris"}}]')


def test_a_tokenizer_llguidance_cannot_read_leaves_a_syntax_check(caplog: pytest.LogCaptureFixture) -> None:
    grammars = GrammarChecker("{not a tokenizer", 512, [2], 30.0)
    assert check(grammars, StructuredOutputsParams(json=SCHEMA)) is None
    assert check(grammars, StructuredOutputsParams(regex="[0-9]+")) is None
    error = check(grammars, StructuredOutputsParams(json={"type": "object", "not": {}}), "response_format")
    assert error is not None and error.status == 400 and error.param == "response_format"
    assert sum("syntax only" in record.message for record in caplog.records) == 1  # logged once
    grammars.close()


def test_string_formats_are_enforced_or_refused_by_name(tokenizer: PreTrainedTokenizerBase) -> None:
    grammars = checker(tokenizer)
    for known in ("date-time", "email", "uuid"):
        assert check(grammars, StructuredOutputsParams(json={"type": "string", "format": known})) is None
    date_time = StructuredOutputsParams(json={"type": "string", "format": "date-time"})
    assert matches(tokenizer, date_time, '"2024-01-31T12:00:00Z"')
    assert not matches(tokenizer, date_time, '"tomorrow"')
    unknown = {"type": "object", "properties": {"link": {"type": "string", "format": "uri-reference"}}}
    error = check(grammars, StructuredOutputsParams(json=unknown), "response_format")
    assert error is not None and error.status == 400 and error.param == "response_format"
    assert "uri-reference" in error.message
    grammars.close()
