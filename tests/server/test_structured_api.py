"""Structured outputs through the openai SDK against a live `cadence serve` on a tiny random
model: every request form (response_format, structured_outputs, guided_*), on chat and
completions, and the 400s for constraints that cannot be served.

A grammar forces valid output from any weights, so random weights are enough: each
answer must parse, match and end with "stop" once the grammar is complete.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal

import httpx
import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from pydantic import BaseModel, ConfigDict, Field

from tests.support.server_checks import CHAT, CMPL, MESSAGES, MODEL, VOCAB_SIZE, assert_error, assert_serves, post
from tests.support.server_harness import ServerProcess

# Enough for any answer of the schemas below: every string is bounded, and a random model
# may spend up to 4 byte tokens on each character.
MAX_TOKENS = 300


class Weather(BaseModel):
    # additionalProperties: false, as OpenAI's strict mode wants; else keys are free text.
    model_config = ConfigDict(extra="forbid")

    city: str = Field(pattern=r"^[A-Z][a-z]{1,10}$")
    unit: Literal["celsius", "fahrenheit"]
    days: int = Field(ge=1, le=7)
    alerts: list[Annotated[str, Field(max_length=6)]] = Field(max_length=2)
    note: str | None = Field(max_length=8)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str]) -> Iterator[ServerProcess]:
    with ServerProcess(tiny_model_dir("llama"), "--num-gpu-blocks", "512", "--served-model-name", MODEL) as process:
        yield process


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def chat(client: openai.OpenAI, **fields: Any) -> ChatCompletion:
    """A chat call; vLLM's fields go in the body beside OpenAI's (the SDK's extra_body)."""
    vllm_fields = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    extra = {k: fields.pop(k) for k in list(fields) if k in vllm_fields}
    options = {"max_tokens": MAX_TOKENS, "seed": 1, **fields}
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, extra_body=extra or None, **options)


def only_text(response: ChatCompletion) -> str:
    (choice,) = response.choices
    assert choice.finish_reason == "stop", choice
    assert choice.message.content is not None
    return choice.message.content


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    schema = Weather.model_json_schema()
    response = chat(
        client,
        response_format={"type": "json_schema", "json_schema": {"name": "weather", "schema": schema, "strict": True}},
    )
    Weather.model_validate_json(only_text(response))


def test_response_format_json_object(client: openai.OpenAI) -> None:
    assert isinstance(json.loads(only_text(chat(client, response_format={"type": "json_object"}))), dict)


def test_the_sdks_parse_helper(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, seed=2, response_format=Weather
    )
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Weather)
    assert completion.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"choice": ["yes", "no", "maybe later"]}},
        {"guided_choice": ["yes", "no", "maybe later"]},
    ],
    ids=["structured-outputs", "guided"],
)
def test_choice_is_exact(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    for seed in range(3):
        assert only_text(chat(client, seed=seed, **fields)) in ("yes", "no", "maybe later")


@pytest.mark.parametrize(
    "fields",
    [{"structured_outputs": {"regex": r"[A-Z][a-z]{2,6} \d{1,3}"}}, {"guided_regex": r"[A-Z][a-z]{2,6} \d{1,3}"}],
    ids=["structured-outputs", "guided"],
)
def test_regex_matches_whole_output(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    assert re.fullmatch(r"[A-Z][a-z]{2,6} \d{1,3}", only_text(chat(client, **fields)))


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"grammar": 'root ::= "x=" [0-9] [0-9]? ("," [0-9])?'}},
        {"guided_grammar": 'root ::= "x=" [0-9] [0-9]? ("," [0-9])?'},
        {"structured_outputs": {"grammar": 'start: "x=" NUM ("," /[0-9]/)?\nNUM: /[0-9]{1,2}/'}},
    ],
    ids=["gbnf", "guided-gbnf", "lark"],
)
def test_grammar(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    assert re.fullmatch(r"x=[0-9]{1,2}(,[0-9])?", only_text(chat(client, max_tokens=12, **fields))), fields


@pytest.mark.parametrize(
    "fields",
    [
        {"structured_outputs": {"json": Weather.model_json_schema()}},
        {"guided_json": Weather.model_json_schema()},
        {"guided_json": json.dumps(Weather.model_json_schema()), "guided_decoding_backend": "xgrammar"},
    ],
    ids=["structured-outputs", "guided", "guided-text-and-backend"],
)
def test_json_forms(client: openai.OpenAI, fields: dict[str, Any]) -> None:
    extra = {k: v for k, v in fields.items() if k == "guided_decoding_backend"}
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=MAX_TOKENS,
        seed=3,
        extra_body={**{k: v for k, v in fields.items() if k != "guided_decoding_backend"}, **extra},
    )
    Weather.model_validate_json(only_text(response))


def test_completions_take_every_form(server: ServerProcess) -> None:
    for fields in (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "w", "schema": Weather.model_json_schema()},
            }
        },
        {"structured_outputs": {"choice": ["alpha", "beta"]}},
        {"guided_regex": "[0-9]{4}"},
    ):
        raw = post(
            server, CMPL, {"model": MODEL, "prompt": "The", "max_tokens": MAX_TOKENS, "n": 2, "seed": 4, **fields}
        )
        assert raw.status_code == 200, raw.text
        completion = Completion.model_validate(raw.json())
        for choice in completion.choices:
            assert choice.finish_reason == "stop", (fields, choice)
            if "response_format" in fields:
                Weather.model_validate_json(choice.text)
            elif "guided_regex" in fields:
                assert re.fullmatch("[0-9]{4}", choice.text)
            else:
                assert choice.text in ("alpha", "beta")


def test_streamed_constrained_output_joins_to_the_same_match(server: ServerProcess) -> None:
    body = {
        "model": MODEL,
        "messages": MESSAGES,
        "max_tokens": MAX_TOKENS,
        "seed": 5,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": Weather.model_json_schema()}},
    }
    with httpx.stream("POST", f"{server.base_url}{CHAT}", json=body, timeout=60) as response:
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert sum(1 for c in chunks for choice in c["choices"] if choice["finish_reason"] is not None) == 1
    Weather.model_validate_json("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks))


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def response_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}


BAD_CONSTRAINTS = [
    ("invalid-schema-type", {"response_format": response_format({"type": "integr"})}, "response_format"),
    ("unsupported-schema-feature", {"response_format": response_format({"not": {"type": "null"}})}, "response_format"),
    ("bad-ref", {"guided_json": {"$ref": "#/$defs/missing"}}, "guided_json"),
    ("schema-not-json", {"guided_json": "{not json"}, "guided_json"),
    ("deeply-nested-schema", {"structured_outputs": {"json": nested_schema(120)}}, "structured_outputs"),
    ("invalid-regex", {"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
    ("invalid-gbnf", {"guided_grammar": "root ::= missing_rule"}, "guided_grammar"),
    ("invalid-lark", {"structured_outputs": {"grammar": "start: @@"}}, "structured_outputs"),
    ("oversize-schema", {"guided_json": {"enum": ["x" * 300_000]}}, "guided_json"),
    ("too-many-choices", {"guided_choice": [str(i) for i in range(5000)]}, "guided_choice"),
    ("empty-choice", {"structured_outputs": {"choice": []}}, "structured_outputs"),
    ("no-constraint", {"structured_outputs": {}}, "structured_outputs"),
    ("two-constraints", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ("two-fields", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("json-schema-missing", {"response_format": {"type": "json_schema"}}, "response_format"),
    (
        "whitespace-pattern",
        {"guided_json": {"type": "object"}, "guided_whitespace_pattern": " *"},
        "guided_whitespace_pattern",
    ),
    ("logit-bias-key", {"logit_bias": {"x5": 1}}, "logit_bias"),
    ("logit-bias-outside-vocab", {"logit_bias": {"100000": 1}}, "logit_bias"),
    ("template-kwargs-reserved", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("prompt-logprobs-streamed", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
]


@pytest.mark.parametrize(
    "fields,param", [(f, p) for _, f, p in BAD_CONSTRAINTS], ids=[i for i, _, _ in BAD_CONSTRAINTS]
)
def test_bad_constraints_are_400s(server: ServerProcess, fields: dict[str, Any], param: str) -> None:
    error = assert_error(post(server, CHAT, {"model": MODEL, "messages": MESSAGES, **fields}), 400, param=param)
    assert error["type"] == "invalid_request_error"


def test_bad_constraint_on_completions(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "hi", "response_format": response_format({"type": "integr"})}
    assert_error(post(server, CMPL, body), 400, param="response_format")


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_json": {"enum": [f"value-{i}" for i in range(10_000)]}},
        {"guided_regex": "(a+)+b"},
        {"guided_regex": "(x|x|xx)*y{0,500}"},
    ],
    ids=["10k-enum", "catastrophic-regex", "ambiguous-repeats"],
)
def test_pathological_but_valid_constraints_are_served(
    server: ServerProcess, client: openai.OpenAI, fields: dict[str, Any]
) -> None:
    response = chat(client, max_tokens=8, **fields)
    assert response.choices[0].finish_reason in ("stop", "length")
    assert_serves(server)


def test_logit_bias_forces_and_bans(server: ServerProcess) -> None:
    def sampled(bias: dict[str, float]) -> str:
        body = {"model": MODEL, "prompt": "The", "max_tokens": 6, "logit_bias": bias, "seed": 7, "ignore_eos": True}
        response = post(server, CMPL, body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    def text_of(token: int) -> str:
        return post(server, "/detokenize", {"model": MODEL, "tokens": [token] * 6}).json()["prompt"]

    # +100 forces a token; -100 on every other token leaves only the one not banned.
    assert sampled({"65": 100}) == text_of(65)
    assert sampled({str(t): -100 for t in range(VOCAB_SIZE) if t != 70}) == text_of(70)


def test_server_serves_after_the_refusals(server: ServerProcess) -> None:
    assert_serves(server)
