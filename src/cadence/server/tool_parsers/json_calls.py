"""What the JSON tool-call parsers share: running one call, and reading the separators between calls.

Every decision depends only on the text up to the character where it is taken (a
trigger's prefix at the end of a feed is held, never guessed at), so any cutting of
the output into feeds gives the same content and the same calls.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.server.text_markers import find_trigger
from cadence.server.tool_parsers.base import DeltaBuilder, ToolParser, ToolSpec
from cadence.server.tool_parsers.call_object import CallObject


class JsonCallParser(ToolParser):
    """A parser whose calls are JSON objects (or JSON arguments) introduced by a marker."""

    argument_keys: tuple[str, ...] = ("arguments",)

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        super().__init__(tools)
        self._pending = ""  # text fed but not yet decided, re-read with the next feed
        self._call: CallObject | None = None
        self._call_index = -1
        self._held = ""  # the marker text of a pending call, content if the call is rejected

    def _text_until(self, trigger: str, buffer: str, position: int, out: DeltaBuilder, final: bool) -> int | None:
        """Send the text from `position` up to the next `trigger` as content and return
        where the text after the trigger starts; None when no trigger is in `buffer`, with
        whatever could still begin one held for the next feed."""
        end, found = find_trigger(buffer, position, [trigger], final)
        out.content(buffer[position:end])
        if found is None:
            self._pending = buffer[end:]
            return None
        return end + len(found)

    def _start_call(self, marker: str, call: CallObject | None = None) -> None:
        self._call = call if call is not None else CallObject(self.tools, self.argument_keys)
        self._call_index = -1
        self._held = marker

    def _run_call(self, text: str, position: int, out: DeltaBuilder) -> tuple[int, str]:
        """Feed text[position:] to the current call; returns where it stopped and why.

        "open": the text ran out; "closed": the call's JSON is complete; "rejected": the
        call was not one (its text went to content); "stopped": a committed call could not
        take the character at the returned position, which is left for the caller."""
        call = self._call
        assert call is not None
        outcome = "open"
        while position < len(text):
            consumed = call.push(text[position])
            if consumed:
                position += 1
            if call.state == "rejected":
                out.content(self._held + call.text())
                self._call = None
                return position, "rejected"
            if not consumed:
                outcome = "stopped"
                break
            if call.done:
                outcome = "closed"
                break
        self._send(out)
        if outcome == "stopped":
            self._end_call()
        return position, outcome

    def _send(self, out: DeltaBuilder) -> None:
        call = self._call
        assert call is not None
        if call.state != "committed":
            return
        if self._call_index < 0:
            self._call_index = self.calls_started
            self.calls_started += 1
        name, arguments = call.take()
        out.call(self._call_index, name, arguments)

    def _end_call(self) -> None:
        assert self._call is not None
        if self._call.state == "committed" and not self._call.arguments_complete:
            self.unfinished_calls.append(self._call_index)
        self._call = None

    def _finish_call(self, out: DeltaBuilder) -> None:
        """The output ended inside a call: a pending one is content, a committed one stays cut short."""
        call = self._call
        assert call is not None
        if call.state == "pending":
            out.content(self._held + call.text())
            self._call = None
        else:
            self._send(out)
            self._end_call()


class Separator:
    """Optional whitespace, then one of `literals` (none a prefix of another), one character at a time."""

    def __init__(self, literals: Sequence[str]) -> None:
        self.literals = literals
        self.text = ""
        self._literal_start = -1

    @property
    def whitespace(self) -> str:
        return self.text if self._literal_start < 0 else self.text[: self._literal_start]

    @property
    def partial_literal(self) -> str:
        return "" if self._literal_start < 0 else self.text[self._literal_start :]

    def push(self, char: str) -> str:
        """ "more", "matched" (the character completed a literal) or "failed" (not consumed)."""
        if self._literal_start < 0:
            if char.isspace():
                self.text += char
                return "more"
            self._literal_start = len(self.text)
        candidate = self.partial_literal + char
        if not any(literal.startswith(candidate) for literal in self.literals):
            return "failed"
        self.text += char
        return "matched" if candidate in self.literals else "more"
