"""Checks, one character at a time, that text is still a prefix of one JSON value.

Tool-call parsers stream a call's arguments while the model writes them, so they need to
know at every character whether the text can still become valid JSON, where the value
ends, and where a streamed fragment may stop without splitting an escape sequence. The
members of the top-level object are recorded (key, and where each value starts and ends)
so a parser can find the `name` and `arguments` of a call without parsing twice.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WHITESPACE = " \t\n\r"
_LITERALS = {"t": "true", "f": "false", "n": "null"}
# Every prefix of a JSON number, and nothing else: digits after a '.' are needed before an exponent.
_NUMBER_PREFIX = re.compile(r"-|-?(0|[1-9][0-9]*)(\.[0-9]*|(\.[0-9]+)?[eE][+-]?[0-9]*)?")
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_HEX = set("0123456789abcdefABCDEF")
_SIMPLE_ESCAPES = set('"\\/bfnrt')


@dataclass
class Member:
    """One key of the top-level object and where its value lies in the scanned text."""

    key: str
    value_start: int = -1  # index of the value's first character; -1 until it starts
    value_end: int = -1  # index just past the value; -1 until it ends


class JsonPrefixScanner:
    """Accepts characters while they extend a prefix of one JSON value (whitespace around it allowed).

    `push` returns False, and changes nothing, for a character that no valid JSON text
    could continue with. Once the value is complete only whitespace is accepted.
    """

    def __init__(self) -> None:
        self.chars: list[str] = []
        self.members: list[Member] = []
        self.top_kind = ""  # "{", "[", '"' or "scalar": the top-level value's first character class
        self._stack: list[str] = []  # open containers, "{" or "["
        self._expect = "value"  # value, key_or_end, key, colon, comma_or_end, value_or_end, done
        self._in_string = False
        self._string_is_key = False
        self._string_start = 0
        self._escape = 0  # 0: none; 1: after a backslash; 2..5: hex digits of \u seen + 2
        self._escape_start = -1
        self._literal = ""  # the rest of true/false/null still to come
        self._number = ""

    @property
    def done(self) -> bool:
        """The value is complete (a trailing number is complete only once something follows it)."""
        return self._expect == "done"

    @property
    def safe_length(self) -> int:
        """How much of the text can be sent on: everything but an unfinished escape sequence."""
        return self._escape_start if self._escape else len(self.chars)

    def text(self, start: int = 0, end: int | None = None) -> str:
        return "".join(self.chars[start:end])

    def finish(self) -> bool:
        """True when the text is a complete JSON value (ends a trailing top-level number)."""
        if self._number and not self._stack:
            if not _NUMBER.fullmatch(self._number):
                return False
            self._number = ""
            self._end_value()
        return self.done

    def push(self, char: str) -> bool:
        if self._in_string:
            accepted = self._push_string(char)
        elif self._literal:
            accepted = self._push_literal(char)
        elif self._number:
            accepted = self._push_number(char)
        else:
            accepted = self._push_structure(char)
        if accepted:
            self.chars.append(char)
        return accepted

    def _push_string(self, char: str) -> bool:
        if self._escape == 1:
            if char == "u":
                self._escape = 2
            elif char in _SIMPLE_ESCAPES:
                self._escape = 0
            else:
                return False
        elif self._escape:
            if char not in _HEX:
                return False
            self._escape = 0 if self._escape == 5 else self._escape + 1
        elif char == "\\":
            self._escape = 1
            self._escape_start = len(self.chars)
        elif char == '"':
            self._in_string = False
            if self._string_is_key:
                if len(self._stack) == 1:
                    self.members.append(Member(key=json.loads(self.text(self._string_start) + '"')))
                self._expect = "colon"
            else:
                self._end_value(len(self.chars) + 1)
        elif ord(char) < 0x20:
            return False
        return True

    def _push_literal(self, char: str) -> bool:
        if char != self._literal[0]:
            return False
        self._literal = self._literal[1:]
        if not self._literal:
            self._end_value(len(self.chars) + 1)
        return True

    def _push_number(self, char: str) -> bool:
        if _NUMBER_PREFIX.fullmatch(self._number + char):
            self._number += char
            return True
        if not _NUMBER.fullmatch(self._number):
            return False
        if char not in _WHITESPACE and (not self._stack or char not in ",]}"):
            return False
        self._number = ""
        self._end_value(len(self.chars))
        return self._push_structure(char)

    def _push_structure(self, char: str) -> bool:
        expect = self._expect
        if char in _WHITESPACE:
            return True
        if expect == "done":
            return False
        if expect == "colon":
            if char != ":":
                return False
            self._expect = "value"
            return True
        if expect in ("key_or_end", "key"):
            if char == "}" and expect == "key_or_end":
                return self._close("}")
            if char != '"':
                return False
            self._open_string(is_key=True)
            return True
        if expect == "comma_or_end":
            if char == ",":
                self._expect = "key" if self._stack[-1] == "{" else "value"
                return True
            return char in "]}" and self._close(char)
        if expect == "value_or_end" and char == "]":
            return self._close("]")
        return self._start_value(char)

    def _start_value(self, char: str) -> bool:
        if char == "{":
            kind = "{"
        elif char == "[":
            kind = "["
        elif char == '"':
            kind = '"'
        elif char in _LITERALS or char == "-" or char.isdigit() and char.isascii():
            kind = "scalar"
        else:
            return False
        if not self._stack:
            self.top_kind = kind
        elif len(self._stack) == 1 and self.members and self._stack[0] == "{":
            self.members[-1].value_start = len(self.chars)
        if kind in "{[":
            self._stack.append(char)
            self._expect = "key_or_end" if char == "{" else "value_or_end"
        elif kind == '"':
            self._open_string(is_key=False)
        elif char in _LITERALS:
            self._literal = _LITERALS[char][1:]
        else:
            self._number = char
        return True

    def _open_string(self, is_key: bool) -> None:
        self._in_string = True
        self._string_is_key = is_key
        self._string_start = len(self.chars)

    def _close(self, char: str) -> bool:
        if self._stack[-1] != ("{" if char == "}" else "["):
            return False
        self._stack.pop()
        self._end_value(len(self.chars) + 1)
        return True

    def _end_value(self, end: int = -1) -> None:
        """A value just ended at `end` (exclusive): record it if it is a top-level member's."""
        if len(self._stack) == 1 and self._stack[0] == "{" and self.members:
            member = self.members[-1]
            if member.value_end < 0:
                member.value_end = end
        self._expect = "comma_or_end" if self._stack else "done"
