"""Structured outputs offline: a grammar makes a tiny random model's output valid, whatever
its weights. Each schema is a pydantic model, whose own validation is the reference."""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable
from typing import Annotated, Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cadence import LLM, SamplingParams
from cadence.structured_outputs.params import StructuredOutputsParams
from tests.support.helpers import make_llm

PROMPTS = ["The quick brown fox", "Paris is the capital of", "Numbers like 12345", "A paged KV cache"]


class Color(enum.Enum):
    RED = "red"
    GREEN = "green"


class Address(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: Annotated[str, Field(max_length=6)]
    zip_code: Annotated[str, Field(pattern=r"^[0-9]{3}$")]


class Person(BaseModel):
    """Nested objects through $defs/$ref (Address twice), enums with and without a type,
    a union with null, bounds, a pattern and bounded arrays."""

    model_config = ConfigDict(extra="forbid")
    name: Annotated[str, Field(min_length=1, max_length=8)]
    age: Annotated[int, Field(ge=0, le=120)]
    color: Color
    kind: Literal["cat", "dog"]
    nickname: Annotated[str, Field(max_length=5)] | None
    home: Address
    work: Address
    scores: Annotated[list[Annotated[int, Field(ge=0, le=9)]], Field(min_length=1, max_length=3)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Callable[[str], str]) -> LLM:
    return make_llm(tiny_model_dir("llama"), max_model_len=512, num_gpu_blocks=1024)


def constrained(max_tokens: int = 300, **constraint: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, structured_outputs=StructuredOutputsParams(**constraint)
    )


def texts(llm: LLM, params: SamplingParams) -> list[str]:
    outputs = llm.generate(PROMPTS, params)
    completions = [c for o in outputs for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in completions), [(c.text, c.finish_reason) for c in completions]
    return [c.text for c in completions]


def test_pydantic_schema_output_validates(llm: LLM) -> None:
    schema = Person.model_json_schema()
    assert "$defs" in schema and "Address" in schema["$defs"]
    for text in texts(llm, constrained(json=schema)):
        Person.model_validate_json(text)


def test_schema_as_json_text_with_any_of_and_untyped_enum(llm: LLM) -> None:
    schema = {
        "type": "object",
        "properties": {
            "level": {"enum": ["low", 3, None]},
            "ratio": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "null"}]},
        },
        "required": ["level", "ratio"],
        "additionalProperties": False,
    }
    for text in texts(llm, constrained(json=json.dumps(schema))):
        value = json.loads(text)
        assert set(value) == {"level", "ratio"}
        assert value["level"] in ("low", 3, None)
        assert value["ratio"] is None or (isinstance(value["ratio"], int) and -5 <= value["ratio"] <= 5)


def test_json_object_is_an_object(llm: LLM) -> None:
    for text in texts(llm, constrained(json_object=True)):
        assert isinstance(json.loads(text), dict)


def test_regex_matches_the_whole_output(llm: LLM) -> None:
    pattern = r"[a-z]{2,5}-[0-9]{1,3}(\.[a-z]{1,4})?"
    for text in texts(llm, constrained(regex=pattern, max_tokens=40)):
        assert re.fullmatch(pattern, text), text


def test_choice_is_exactly_one_choice(llm: LLM) -> None:
    choices = ("yes", "no", "maybe not")
    outputs = texts(llm, constrained(choice=choices, max_tokens=10))
    assert all(text in choices for text in outputs), outputs


def test_gbnf_grammar(llm: LLM) -> None:
    grammar = 'root ::= "(" item ("," item)? ")"\nitem ::= [0-9] | "x"'
    for text in texts(llm, constrained(grammar=grammar, max_tokens=20)):
        assert re.fullmatch(r"\(([0-9]|x)(,([0-9]|x))?\)", text), text


def test_an_invalid_grammar_is_refused_before_anything_runs(llm: LLM) -> None:
    with pytest.raises(ValueError, match="foo"):
        llm.generate(PROMPTS[:1], constrained(grammar="start: foo"))
    with pytest.raises(ValueError):
        llm.generate(PROMPTS[:1], constrained(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}))
    assert not llm.engine.has_unfinished_requests()
    assert texts(llm, constrained(choice=("a", "b"), max_tokens=5))  # and the engine serves on


def test_max_tokens_reached_first_ends_with_length_not_a_complete_object(llm: LLM) -> None:
    """max_tokens that ends a constrained output early says "length": never a claim of
    completion, and the text is not valid against the schema."""
    outputs = llm.generate(PROMPTS, constrained(json=Person.model_json_schema(), max_tokens=6))
    for completion in (c for o in outputs for c in o.outputs):
        assert completion.finish_reason == "length"
        assert len(completion.token_ids) == 6
        with pytest.raises(ValidationError):
            Person.model_validate_json(completion.text)


def test_eos_that_ends_an_open_ended_grammar_is_a_stop_token_not_text(llm: LLM) -> None:
    """A grammar that may stop or go on ends when the model samples EOS: as any EOS ends a
    request (kept in token_ids, never in the text, special tokens shown or not)."""
    pattern = "[ab]{1,30}"
    for ignore_eos in (False, True):
        params = SamplingParams(
            max_tokens=40,
            temperature=1.0,
            seed=0,
            skip_special_tokens=False,
            ignore_eos=ignore_eos,
            structured_outputs=StructuredOutputsParams(regex=pattern),
        )
        (output,) = llm.generate([[5, 6, 7, 8]], params)
        completion = output.outputs[0]
        assert completion.token_ids[-1] in llm.engine.eos_token_ids, completion.token_ids
        assert completion.finish_reason == "stop" and completion.stop_reason is None
        assert re.fullmatch(pattern, completion.text), completion.text
