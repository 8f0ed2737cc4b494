"""Hermes-style calls, as Qwen2.5, Qwen3, Hermes and many fine-tunes write them.

    Let me check.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Any number of calls, with text before, between and after them. The tags are read as
text, so it makes no difference whether the tokenizer has special tokens for them.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.server.tool_parsers.base import DeltaBuilder, ToolSpec
from cadence.server.tool_parsers.call_grammar import tagged_call_grammar
from cadence.server.tool_parsers.json_calls import JsonCallParser, Separator

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


class HermesToolParser(JsonCallParser):
    name = "hermes"

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        super().__init__(tools)
        self._mode = "text"  # text, call, or close (after a call's JSON: whitespace then CLOSE_TAG)
        self._close = Separator([CLOSE_TAG])

    def _advance(self, text: str, out: DeltaBuilder, final: bool) -> None:
        buffer, self._pending = self._pending + text, ""
        position = 0
        while True:
            if self._mode == "text":
                after = self._text_until(OPEN_TAG, buffer, position, out, final)
                if after is None:
                    break
                position = after
                self._start_call(OPEN_TAG)
                self._mode = "call"
            elif self._mode == "call":
                position, outcome = self._run_call(buffer, position, out)
                if outcome == "open":
                    break
                if outcome == "closed":
                    self._end_call()
                    self._close = Separator([CLOSE_TAG])
                    self._mode = "close"
                else:
                    self._mode = "text"
            else:
                if position == len(buffer):
                    break
                status = self._close.push(buffer[position])
                if status == "failed":
                    # Not the closing tag: the whitespace is content, and what looked like the
                    # tag's start is read again as text (it may open the next call).
                    out.content(self._close.whitespace)
                    buffer = self._close.partial_literal + buffer[position:]
                    position = 0
                    self._mode = "text"
                else:
                    position += 1
                    if status == "matched":
                        self._mode = "text"
        if final:
            if self._mode == "call":
                self._finish_call(out)
            elif self._mode == "close":
                out.content(self._close.text)
            self._mode = "text"

    def auto_grammar(self) -> str | None:
        return tagged_call_grammar(self.tools, OPEN_TAG, begin="\n", end="\n" + CLOSE_TAG)
