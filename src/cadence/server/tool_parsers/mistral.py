"""Mistral tool calls, after the `[TOOL_CALLS]` marker, in both of Mistral's forms.

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]    (tokenizer v3 and earlier)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}      (tokenizer v11 and later)
    [TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris"}              (with the model's call id)

The model's call id is markup: the server gives every call an id of its own.

`[TOOL_CALLS]` is a special token: the server detokenizes with special tokens kept
(needs_special_tokens) for this parser to see it. Other special tokens the model writes
mid-answer then reach the content, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence

from cadence.server.tool_parsers.base import DeltaBuilder, ToolSpec
from cadence.server.tool_parsers.call_object import CallObject
from cadence.server.tool_parsers.json_calls import JsonCallParser, Separator

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"
CALL_ID = "[CALL_ID]"


class MistralToolParser(JsonCallParser):
    name = "mistral"
    needs_special_tokens = True

    def __init__(self, tools: Sequence[ToolSpec]) -> None:
        super().__init__(tools)
        # text; form (after the marker: `[` or a name); name, then call_id where the model writes
        # one, then ARGS; call; listed (between list items)
        self._mode = "text"
        self._name = ""
        self._tag = ""  # how much of ARGS or CALL_ID has been read after the name or the id
        self._between = Separator([",", "]"])

    def _advance(self, text: str, out: DeltaBuilder, final: bool) -> None:
        buffer, self._pending = self._pending + text, ""
        position = 0
        while True:
            if self._mode == "text":
                after = self._text_until(TOOL_CALLS, buffer, position, out, final)
                if after is None:
                    break
                position = after
                self._held = TOOL_CALLS
                self._mode = "form"
            elif self._mode == "call":
                position, outcome = self._run_call(buffer, position, out)
                if outcome == "open":
                    break
                if outcome == "closed":
                    self._end_call()
                    if self._name:  # the named form: a call ends with its arguments
                        self._mode = "text"
                    else:
                        self._between = Separator([",", "]"])
                        self._mode = "listed"
                else:
                    self._mode = "text"
            elif position == len(buffer):
                break
            elif self._mode == "listed":
                status = self._between.push(buffer[position])
                if status == "failed":
                    out.content(self._between.text)
                    self._mode = "text"
                    continue
                position += 1
                if status == "matched":
                    if self._between.text.endswith(","):
                        self._start_call(self._between.text)
                        self._mode = "call"
                    else:
                        self._mode = "text"
            else:
                buffer, position = self._read_head(buffer, position, out)
        if final:
            if self._mode == "call":
                self._finish_call(out)
            elif self._mode == "listed":
                out.content(self._between.text)
            elif self._mode in ("form", "name", "call_id"):
                out.content(self._held)
            self._mode = "text"

    def _read_head(self, buffer: str, position: int, out: DeltaBuilder) -> tuple[str, int]:
        """One character after the marker: the list's `[`, or the name (id) and ARGS of the named form."""
        char = buffer[position]
        if self._mode == "form":
            if char.isspace():
                self._held += char
                return buffer, position + 1
            if char == "[":
                self._name = ""
                self._start_call(self._held + char)
                self._mode = "call"
                return buffer, position + 1
            self._name = ""
            self._tag = ""
            self._mode = "name"
        tag = self._tag + char
        if self._mode == "name" and not self._tag and char != "[":
            if any(tool.startswith(self._name + char) for tool in self.tools):
                self._name += char
                self._held += char
                return buffer, position + 1
        elif self._mode == "call_id" and not self._tag and char.isascii() and char.isalnum():
            self._held += char
            return buffer, position + 1
        elif self._name in self.tools and any(marker.startswith(tag) for marker in self._markers_after()):
            self._tag = tag
            self._held += char
            if tag == CALL_ID:
                self._mode = "call_id"
                self._tag = ""
            elif tag == ARGS:
                self._start_call(self._held, CallObject.arguments_only(self.tools, self._name))
                self._mode = "call"
            return buffer, position + 1
        # Not a call of a known tool: its text is content; a partial marker is read again as text.
        out.content(self._held[: len(self._held) - len(self._tag)])
        self._mode = "text"
        self._name = ""
        return self._tag + buffer[position:], 0

    def _markers_after(self) -> tuple[str, ...]:
        """What may follow the name (an id first, in some versions) or the id."""
        return (ARGS, CALL_ID) if self._mode == "name" else (ARGS,)

    def auto_grammar(self) -> str | None:
        # The trigger is a special token, which a grammar written in text cannot name.
        return None
