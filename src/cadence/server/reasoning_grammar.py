"""Constraints that apply to the answer after the reasoning, as vLLM applies them.

With a reasoning parser, a constraint must leave the thinking free and bind only what
follows its end marker. The constraint is wrapped in an llguidance Lark grammar: free
text up to and including the end marker (lazily: the first end marker ends it), a
little whitespace, then the constrained answer, embedded whole (`%json` for a schema,
`%lark { ... }` for a regex, choice or grammar).

When the wrap applies:
- the rendered prompt leaves a reasoning block open (DeepSeek-R1's template ends with
  `<think>`, ReasoningParser.starts_in_reasoning): the output starts inside it, so the
  wrap always applies;
- otherwise, when the model may open a block itself after this prompt
  (ReasoningParser.opening_marker: Qwen3 with thinking on by default), the block is
  optional;
- otherwise the constraint binds the output from its first token (thinking closed by the
  template, as Qwen3's `enable_thinking: false` renders it).
"""

from __future__ import annotations

import json
import re

from cadence.structured_outputs.grammar import grammar_text
from cadence.structured_outputs.params import StructuredOutputsParams


def _lark_regex(pattern: str) -> str:
    return "/" + pattern.replace("/", "\\/") + "/"


def _answer_rule(params: StructuredOutputsParams) -> str:
    """The constraint as one Lark rule's body."""
    text = grammar_text(params)
    if not text.lstrip().startswith("{"):
        return "%lark {\n" + text + "\n}"
    (grammar,) = json.loads(text)["grammars"]
    if grammar.get("json_schema") is not None:
        # The schema carries grammar_text's JSON options ("x-guidance"), so inline it is
        # read exactly as on its own.
        return "%json " + json.dumps(grammar["json_schema"])
    return "%lark {\n" + grammar["lark_grammar"] + "\n}"


def after_reasoning(
    params: StructuredOutputsParams, end_marker: str, start_marker: str | None, starts_open: bool
) -> StructuredOutputsParams:
    """`params` bound to the answer after the reasoning (see the module's rules); the
    params themselves when the output cannot start with reasoning."""
    if not starts_open and start_marker is None:
        return params
    end = _lark_regex("(?s:.*)" + re.escape(end_marker))
    if starts_open:
        thinking = f"thinking[lazy]: {end}"
        start = "start: thinking GAP answer"
    else:
        assert start_marker is not None
        thinking = f"thinking[lazy]: {json.dumps(start_marker)} {end}"
        start = "start: (thinking GAP)? answer"
    rules = [start, thinking, "GAP: /[ \\t\\n]*/", "answer: " + _answer_rule(params)]
    return StructuredOutputsParams(grammar="\n".join(rules) + "\n")
