"""A request's constraint as llguidance grammar text, bounded and checked.

Schemas, regexes and grammars come from clients and are untrusted: their text is bounded
here, and llguidance's parser limits bound the work a grammar can cause when it is built
and at every token. The same text is built in the API process (to refuse a bad request
with a 400 before it is queued) and in the engine (to compile it).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from cadence.structured_outputs.params import StructuredOutputsParams

# The longest schema, regex or grammar text a request may carry. Large tool sets stay
# well inside it; a multi-megabyte schema is an attack or a mistake.
MAX_GRAMMAR_TEXT = 256 * 1024
MAX_CHOICES = 4096
# Keywords accepted but not enforced. pydantic writes uniqueItems for every set[...]
# field; a grammar cannot tell an array's items apart without a state per item seen.
TOLERATED_KEYWORDS = frozenset({"uniqueItems"})
_UNIMPLEMENTED = "Unimplemented keys: "
# A string format llguidance has no pattern for: lenient compiling drops it with this warning.
_UNKNOWN_FORMAT = "Unknown format: "


class GrammarError(ValueError):
    """A constraint that cannot be served: the message says why, for a 400 body."""


def parser_limits() -> llguidance.LLParserLimits:
    """The bounds every grammar is built and run under.

    llguidance's defaults already stop runaway regexes and Earley blow-ups; verbose errors
    are off because their parser dumps would echo the client's grammar back in logs.
    """
    return llguidance.LLParserLimits(verbose_errors=False)


def _json_text(schema: dict[str, Any] | str) -> str:
    try:
        if isinstance(schema, str):
            schema = json.loads(schema)
        if not isinstance(schema, dict):
            raise GrammarError("a JSON schema must be a JSON object")
        return json.dumps(schema)
    except json.JSONDecodeError as error:
        raise GrammarError(f"the JSON schema is not valid JSON: {error}") from None
    except RecursionError:
        raise GrammarError("the JSON schema is nested too deeply") from None


def _bounded(text: str, what: str) -> str:
    if len(text) > MAX_GRAMMAR_TEXT:
        raise GrammarError(f"the {what} has {len(text)} characters; at most {MAX_GRAMMAR_TEXT} are accepted")
    return text


def json_options(whitespace_flexible: bool = False) -> dict[str, Any]:
    """How every JSON schema is compiled ("x-guidance" options)."""
    # Lenient: unknown keywords become warnings, which check_grammar refuses unless tolerated.
    options: dict[str, Any] = {"whitespace_flexible": whitespace_flexible, "lenient": True}
    if not whitespace_flexible:
        options.update(item_separator=", ", key_separator=": ")
    return options


def inline_json_schema(schema: dict[str, Any], whitespace_flexible: bool = False) -> str:
    """`%json {...}` for a Lark rule: the schema read exactly as grammar_text reads it alone."""
    return "%json " + json.dumps({**schema, "x-guidance": json_options(whitespace_flexible)})


def grammar_text(params: StructuredOutputsParams) -> str:
    """llguidance's grammar text for the constraint; GrammarError for text it cannot take."""
    options: Any = json_options(params.whitespace_flexible)
    kind = params.kind
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', overrides=options)
    if kind == "json":
        assert params.json is not None
        schema = _bounded(_json_text(params.json), "JSON schema")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as error:
            raise GrammarError(f"the JSON schema could not be read: {error}") from None
    if kind == "regex":
        assert params.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(_bounded(params.regex, "regex"))
    if kind == "choice":
        assert params.choice is not None
        if len(params.choice) > MAX_CHOICES:
            raise GrammarError(f"at most {MAX_CHOICES} choices are accepted, not {len(params.choice)}")
        _bounded("".join(params.choice), "choice list")
        # Each choice as a Lark string literal: matched exactly, nothing added around it.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
    assert params.grammar is not None
    try:
        return llguidance.grammar_from("grammar", _bounded(params.grammar, "grammar"))
    except ValueError as error:
        raise GrammarError(str(error)) from None


def check_grammar(grammar: str, tokenizer: llguidance.LLTokenizer | None = None) -> None:
    """GrammarError naming the first problem llguidance finds in the grammar, if any.

    Drops the GIL while llguidance builds the grammar, which is bounded by the parser limits."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=parser_limits())
    if is_error:
        raise GrammarError(messages[0])
    for message in messages:
        if message.startswith(_UNIMPLEMENTED):
            unsupported = sorted(set(json.loads(message[len(_UNIMPLEMENTED) :])) - TOLERATED_KEYWORDS)
            if unsupported:
                raise GrammarError(f"the JSON schema uses keywords that cannot be enforced: {', '.join(unsupported)}")
        elif message.startswith(_UNKNOWN_FORMAT):
            raise GrammarError(
                f"the JSON schema uses a string format that cannot be enforced: {message[len(_UNKNOWN_FORMAT) :]}"
            )


def ll_tokenizer(backend_tokenizer_json: str, vocab_size: int, eos_token_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a tokenizer, from the `tokenizers` JSON of a fast tokenizer.

    `vocab_size` is the model's logits width, which may exceed the tokenizer's (padded
    embedding tables): masks are that wide, and ids beyond the tokenizer are never allowed.
    Building it takes about a second for a large vocabulary: build it once per process.
    """
    return llguidance.LLTokenizer(backend_tokenizer_json, n_vocab=vocab_size, eos_token=eos_token_ids)
