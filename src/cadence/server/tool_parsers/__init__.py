"""Tool-call parsers for `tool_choice: auto`, by the names `--tool-call-parser` takes (vLLM's)."""

from __future__ import annotations

from cadence.server.tool_parsers.base import CallDelta, ParsedDelta, ToolParser, ToolSpec
from cadence.server.tool_parsers.hermes import HermesToolParser
from cadence.server.tool_parsers.llama3_json import Llama3JsonToolParser
from cadence.server.tool_parsers.mistral import MistralToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    parser.name: parser for parser in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class called `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "CallDelta", "ParsedDelta", "ToolParser", "ToolSpec", "get_tool_parser"]
