"""What a request constrains its output to, with vLLM's field names and meanings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of `json`, `json_object`, `regex`, `choice` or `grammar`.

    `json` is a JSON Schema (a dict or its JSON text); `json_object` any JSON object;
    `regex` a regular expression the whole output matches; `choice` one of the strings,
    exactly; `grammar` a GBNF grammar as llama.cpp writes it (`root ::= ...`) or a Lark
    grammar in llguidance's dialect (`start: ...`). JSON is written without free
    whitespace (", " and ": " between items) unless `whitespace_flexible` is set: free
    whitespace lets a weak model pad forever instead of finishing the object.
    """

    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    whitespace_flexible: bool = False

    def __post_init__(self) -> None:
        if self.choice is not None and not isinstance(self.choice, tuple):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise ValueError(
                f"structured outputs take exactly one of json, json_object, regex, choice or grammar; got {named}"
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) for c in self.choice)):
            raise ValueError("choice must be a non-empty list of strings")

    @property
    def kind(self) -> str:
        """Which of the constraint fields is set."""
        if self.json_object:
            return "json_object"
        return next(name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None)

    def cache_key(self) -> str:
        """One string per distinct constraint: compiled grammars are cached under it."""
        value: Any = getattr(self, self.kind)
        if isinstance(value, dict):
            value = json.dumps(value, sort_keys=True, separators=(",", ":"))
        return json.dumps([self.kind, value, self.whitespace_flexible])
