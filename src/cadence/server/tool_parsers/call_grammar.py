"""llguidance grammars for `tool_choice: auto`: free text, and calls held to the tools' schemas.

Text is unconstrained until the format's trigger appears (a lazy lexeme, so it ends at the
trigger's first occurrence); from there the call must be `{"name": <a tool>, "arguments":
<that tool's schema>}` followed by the format's closing text, and then text is free again.
The grammars spell triggers as text: a tokenizer that holds a trigger as a *special* token
(Mistral's `[TOOL_CALLS]`, Llama's `<|python_tag|>`) never produces that text, so those
triggers are not offered.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from cadence.server.tool_parsers.base import ToolSpec
from cadence.structured_outputs.grammar import inline_json_schema


def object_schema(parameters: dict[str, Any]) -> dict[str, Any]:
    """The tool's parameters schema, made to describe an object where it leaves the type open."""
    if "type" in parameters or any(key in parameters for key in ("anyOf", "oneOf", "allOf", "$ref", "enum", "const")):
        return parameters
    return {"type": "object", **parameters}


def _lark_string(text: str) -> str:
    return json.dumps(text)


def _tool_rules(tools: Mapping[str, ToolSpec], argument_key: str) -> tuple[str, list[str]]:
    """The alternatives `tool_0 | tool_1 ...` and their rules, one per tool."""
    names = []
    rules = []
    for number, tool in enumerate(tools.values()):
        head = '{"name": ' + json.dumps(tool.name) + ", " + json.dumps(argument_key) + ": "
        schema = inline_json_schema(object_schema(tool.parameters))
        names.append(f"tool_{number}")
        rules.append(f'tool_{number}: {_lark_string(head)} {schema} "}}"')
    return " | ".join(names), rules


def tagged_call_grammar(tools: Mapping[str, ToolSpec], trigger: str, begin: str, end: str) -> str | None:
    """Any text, with calls written as `trigger begin {call} end` wherever the trigger appears."""
    if not tools:
        return None
    alternatives, rules = _tool_rules(tools, "arguments")
    lines = [
        "%llguidance {}",
        "start: tool_call* free_text",
        "free_text: TEXT",
        r"TEXT: /(.|\n)*/",
        f"call_head[lazy]: TEXT {_lark_string(trigger)}",
        f"tool_call: call_head {_lark_string(begin)} ({alternatives}) {_lark_string(end)}",
        *rules,
    ]
    return "\n".join(lines) + "\n"


def leading_calls_grammar(tools: Mapping[str, ToolSpec], argument_key: str, separator: str) -> str | None:
    """Either text that does not open with `{`, or only calls, joined by `separator`."""
    if not tools:
        return None
    alternatives, rules = _tool_rules(tools, argument_key)
    lines = [
        "%llguidance {}",
        "start: free_text | calls",
        "free_text: TEXT",
        r"TEXT: /(?s:.*)/ & ~/[ \t\r\n]*\{(?s:.*)/",
        f"calls: call ({_lark_string(separator)} call)*",
        f"call: {alternatives}",
        *rules,
    ]
    return "\n".join(lines) + "\n"
