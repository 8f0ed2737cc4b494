"""Reasoning parsers, by the names `--reasoning-parser` takes (vLLM's)."""

from __future__ import annotations

from cadence.server.reasoning.base import ReasoningDelta, ReasoningParser
from cadence.server.reasoning.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    parser.name: parser for parser in (Qwen3ReasoningParser, DeepSeekR1ReasoningParser)
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    """The parser class called `name`; ValueError naming the known ones otherwise."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = ["REASONING_PARSERS", "ReasoningDelta", "ReasoningParser", "get_reasoning_parser"]
