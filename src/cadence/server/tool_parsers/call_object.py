"""One tool call written as a JSON object, `{"name": ..., "arguments": {...}}`, read as it arrives.

The call is *pending* until its name is complete and names a known tool and its
arguments have started as an object (or, given as a JSON string, are complete and hold
an object); a pending call that goes wrong is rejected and its text becomes content.
Once *committed*, the name is sent and the arguments stream as the model writes them,
in fragments that never split an escape sequence. A committed call cannot be taken back:
if its text stops being valid JSON, or the output ends inside it, the call ends there
with the arguments written so far (`arguments_complete` False).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from cadence.server.tool_parsers.base import ToolSpec
from cadence.server.tool_parsers.json_prefix import JsonPrefixScanner, Member


class CallObject:
    def __init__(self, tools: Mapping[str, ToolSpec], argument_keys: tuple[str, ...] = ("arguments",)) -> None:
        self._tools = tools
        self._argument_keys = argument_keys
        self._scanner = JsonPrefixScanner()
        self.state = "pending"  # pending, committed or rejected
        self.name: str | None = None
        self._name_sent = False
        self._string_arguments: str | None = None  # arguments given as a JSON string, decoded
        self._sent_upto = -1  # scanner index up to which object arguments were sent
        self._empty_sent = False
        self._prefix_length = 0

    @classmethod
    def arguments_only(cls, tools: Mapping[str, ToolSpec], name: str) -> CallObject:
        """A call whose name was written outside JSON: only its arguments object follows."""
        call = cls(tools)
        for char in '{"name": ' + json.dumps(name) + ', "arguments": ':
            call.push(char)
        call._prefix_length = len(call._scanner.chars)
        return call

    @property
    def done(self) -> bool:
        """The call's JSON text is complete: its object closed, or its arguments for `arguments_only`."""
        if self._prefix_length:
            return self.arguments_complete
        return self._scanner.done

    @property
    def arguments_complete(self) -> bool:
        arguments = self._member(self._argument_keys)
        if arguments is None:
            return self._scanner.done
        return arguments.value_end >= 0 and self._arguments_valid(arguments)

    def text(self) -> str:
        """Everything this call consumed: its text as content when it is rejected."""
        return self._scanner.text(self._prefix_length)

    def push(self, char: str) -> bool:
        """Consume one character; False (not consumed) where no well-formed call continues with it.

        A pending call may also be rejected after consuming the character that settles it
        (the closing quote of an unknown name, say): then `state` is "rejected"."""
        if self.state == "rejected" or not self._scanner.push(char):
            self.state = "rejected" if self.state == "pending" else self.state
            return False
        if self.state == "pending":
            self.state = self._settle()
        return True

    def take(self) -> tuple[str | None, str]:
        """The name, the first time a committed call is asked, and the arguments text not yet sent."""
        if self.state != "committed":
            return None, ""
        name = None
        if not self._name_sent:
            self._name_sent = True
            name = self.name
        return name, self._new_arguments()

    def _member(self, keys: tuple[str, ...]) -> Member | None:
        return next((member for member in self._scanner.members if member.key in keys), None)

    def _arguments_valid(self, arguments: Member) -> bool:
        if self._scanner.chars[arguments.value_start] == "{":
            return True
        return self._string_arguments is not None

    def _settle(self) -> str:
        """Pending, committed or rejected, from what the call's text shows so far."""
        scanner = self._scanner
        if scanner.top_kind not in ("", "{"):
            return "rejected"
        name = self._member(("name",))
        if name is not None and name.value_start >= 0:
            if scanner.chars[name.value_start] != '"':
                return "rejected"
            if name.value_end >= 0 and self.name is None:
                self.name = json.loads(scanner.text(name.value_start, name.value_end))
                if self.name not in self._tools:
                    return "rejected"
        arguments = self._member(self._argument_keys)
        arguments_ready = scanner.done
        if arguments is not None and arguments.value_start >= 0:
            first = scanner.chars[arguments.value_start]
            if first not in '{"':
                return "rejected"
            if first == '"' and arguments.value_end >= 0 and self._string_arguments is None:
                self._string_arguments = _object_text(scanner.text(arguments.value_start, arguments.value_end))
                if self._string_arguments is None:
                    return "rejected"
            arguments_ready = first == "{" or self._string_arguments is not None
        if self.name is None:
            return "rejected" if scanner.done else "pending"
        return "committed" if arguments_ready else "pending"

    def _new_arguments(self) -> str:
        arguments = self._member(self._argument_keys)
        if arguments is None:
            if self._scanner.done and not self._empty_sent:
                self._empty_sent = True
                return "{}"
            return ""
        if self._string_arguments is not None:
            text, self._string_arguments = self._string_arguments, ""
            return text
        start = max(self._sent_upto, arguments.value_start)
        end = self._scanner.safe_length if arguments.value_end < 0 else arguments.value_end
        if end <= start:
            return ""
        self._sent_upto = end
        return self._scanner.text(start, end)


def _object_text(encoded: str) -> str | None:
    """The JSON text inside a JSON string literal when it holds an object, else None."""
    decoded = json.loads(encoded)
    try:
        value = json.loads(decoded, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # nested past Python's parser: not arguments we can take
        return None
    return decoded if isinstance(value, dict) else None


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")
