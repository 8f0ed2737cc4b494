"""Llama 3.1/3.2 JSON tool calls: the answer is the calls, `;`-separated, optionally after `<|python_tag|>`.

    {"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}

A call is recognised where the output opens with `{` (after whitespace), right after a
previous call, or after `<|python_tag|>` anywhere; any other text is content. Some
fine-tunes write `arguments` instead of `parameters`; both are read.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.server.tool_parsers.base import DeltaBuilder, ToolSpec
from cadence.server.tool_parsers.call_grammar import leading_calls_grammar
from cadence.server.tool_parsers.json_calls import JsonCallParser, Separator

PYTHON_TAG = "<|python_tag|>"
SEPARATOR = ";"


class Llama3JsonToolParser(JsonCallParser):
    name = "llama3_json"
    argument_keys = ("parameters", "arguments")

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        super().__init__(tools)
        # The output may open with a call: read it as one until it shows it is not.
        self._start_call("")
        self._mode = "call"  # text, call, or between (after a call: whitespace, then `;` or the next `{`)
        self._between = Separator([SEPARATOR])

    def _advance(self, text: str, out: DeltaBuilder, final: bool) -> None:
        buffer, self._pending = self._pending + text, ""
        position = 0
        while True:
            if self._mode == "text":
                after = self._text_until(PYTHON_TAG, buffer, position, out, final)
                if after is None:
                    break
                position = after
                self._start_call(PYTHON_TAG)
                self._mode = "call"
            elif self._mode == "call":
                position, outcome = self._run_call(buffer, position, out)
                if outcome == "open":
                    break
                if outcome == "closed":
                    self._end_call()
                    self._between = Separator([SEPARATOR])
                    self._mode = "between"
                else:
                    self._mode = "text"
            else:
                if position == len(buffer):
                    break
                char = buffer[position]
                if char == "{" and not self._between.partial_literal:
                    # Calls on their own lines, with no `;` between them.
                    self._start_call(self._between.text)
                    self._mode = "call"
                    continue
                status = self._between.push(char)
                if status == "failed":
                    out.content(self._between.text)
                    self._mode = "text"
                else:
                    position += 1
                    if status == "matched":
                        self._start_call(self._between.text)
                        self._mode = "call"
        if final:
            if self._mode == "call":
                self._finish_call(out)
            elif self._mode == "between":
                out.content(self._between.text)
            self._mode = "text"

    def auto_grammar(self) -> str | None:
        return leading_calls_grammar(self.tools, "parameters", SEPARATOR + " ")
