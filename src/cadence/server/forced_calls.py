"""Reading forced tool calls back from the constrained output, as it streams.

A named choice's output is the call's arguments; a `required` choice's output is a JSON
array of {"name": ..., "parameters": ...} (server/tool_calls.py). The grammar makes both
valid JSON, so these readers need no error recovery: they only cut the text into call
deltas as it arrives, with the same interface as the auto parsers (feed, finish).
"""

from __future__ import annotations

import json

from cadence.server.tool_parsers.base import CallDelta, ParsedDelta
from cadence.server.tool_parsers.json_prefix import JsonPrefixScanner


class NamedCallReader:
    """The whole output is one call's arguments. Whitespace before them (what follows a
    reasoning block's end marker) is not part of them."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False
        # Whether the arguments are whole: the grammar keeps them a JSON prefix, but a stop
        # string or max_tokens may cut them.
        self._scanner = JsonPrefixScanner()
        self._valid = True
        self._complete = False

    def feed(self, text: str) -> ParsedDelta:
        if not self.started:
            text = text.lstrip()
            if not text:
                return ParsedDelta("", [])
            self.started = True
            self._scan(text)
            return ParsedDelta("", [CallDelta(0, self.name, text)])
        self._scan(text)
        return ParsedDelta("", [CallDelta(0, None, text)] if text else [])

    def _scan(self, text: str) -> None:
        if self._valid:
            self._valid = all(self._scanner.push(char) for char in text)

    def finish(self) -> ParsedDelta:
        self._complete = self._valid and self._scanner.finish()
        return ParsedDelta("", [])

    @property
    def unfinished_calls(self) -> list[int]:
        return [0] if self.started and not self._complete else []


class RequiredCallsReader:
    """A JSON array of calls, read character by character: a call's name is sent once it
    is complete, its parameters' text as it comes (and any of it that came before the
    name right after the name)."""

    def __init__(self) -> None:
        self.text = ""
        self.depth = 0  # 0 outside the array, 1 in it, 2 in a call object, more inside values
        self.in_string = False
        self.escaped = False
        self.key: str | None = None  # the call object's key whose value is being read
        self.token_start = -1  # where the current key's or value's text begins
        self.calls: list[_Call] = []

    def feed(self, text: str) -> ParsedDelta:
        start = len(self.text)
        self.text += text
        for position in range(start, len(self.text)):
            self._step(position, self.text[position])
        return ParsedDelta("", self._deltas())

    def finish(self) -> ParsedDelta:
        return ParsedDelta("", self._deltas())

    def _step(self, position: int, char: str) -> None:
        if self.in_string:
            if self.escaped:
                self.escaped = False
            elif char == "\\":
                self.escaped = True
            elif char == '"':
                self.in_string = False
                if self.depth == 2 and self.key is None:
                    self.key = json.loads(self.text[self.token_start : position + 1])
            return
        if char == '"':
            self.in_string = True
            if self.depth == 2 and self.key is None:
                self.token_start = position
            return
        if char == ":" and self.depth == 2:
            self.token_start = position + 1
        elif char in "[{":
            self.depth += 1
            if self.depth == 2:
                self.calls.append(_Call())
        elif char in "]}":
            if self.depth == 2:
                self._end_value(position)
            self.depth -= 1
        elif char == "," and self.depth == 2:
            self._end_value(position)

    def _end_value(self, position: int) -> None:
        if self.key is not None:
            self._value_text(self.key, self.text[self.token_start : position].strip(), complete=True)
        self.key = None

    def _value_text(self, key: str, text: str, complete: bool) -> None:
        call = self.calls[-1]
        if key == "name" and complete:
            call.name = json.loads(text)
        elif key == "parameters":
            call.arguments = text
            call.complete = complete

    @property
    def unfinished_calls(self) -> list[int]:
        # Indexes as in the deltas; a call whose name never came was never sent.
        return [index for index, call in enumerate(self.calls) if call.name is not None and not call.complete]

    def _deltas(self) -> list[CallDelta]:
        if self.depth > 2 and self.key == "parameters":
            self._value_text("parameters", self.text[self.token_start :].lstrip(), complete=False)
        deltas = []
        for index, call in enumerate(self.calls):
            if call.name is None:
                continue
            name = None if call.announced else call.name
            fresh = call.arguments[call.sent :]
            if name is None and not fresh:
                continue
            call.announced = True
            call.sent = len(call.arguments)
            deltas.append(CallDelta(index, name, fresh))
        return deltas


class _Call:
    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments = ""
        self.announced = False
        self.sent = 0
        self.complete = False  # the parameters' value ended
