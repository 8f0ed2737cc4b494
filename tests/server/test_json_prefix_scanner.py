"""The incremental JSON scanner the tool-call parsers stream arguments with, against `json`."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.server.tool_parsers.json_prefix import JsonPrefixScanner
from tests.support.tool_call_outputs import OPEN_ESCAPE


def _json_values() -> st.SearchStrategy[Any]:
    scalars = (
        st.none()
        | st.booleans()
        | st.integers()
        | st.floats(allow_nan=False, allow_infinity=False)
        | st.text(max_size=6)
    )
    return st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
        max_leaves=8,
    )


@settings(max_examples=300, deadline=None)
@given(value=_json_values(), ascii_only=st.booleans(), indent=st.sampled_from([None, 0, 2]))
def test_scanner_accepts_every_prefix_of_valid_json(value: Any, ascii_only: bool, indent: int | None) -> None:
    text = json.dumps({"v": value}, ensure_ascii=ascii_only, indent=indent)
    scanner = JsonPrefixScanner()
    for position, char in enumerate(text):
        assert scanner.push(char), f"refused {char!r} at {position} of {text!r}"
        assert not OPEN_ESCAPE.search(text[: scanner.safe_length])
        assert scanner.done == (position == len(text) - 1)


@settings(max_examples=500, deadline=None)
@given(text=st.text(alphabet='{}[]",:\\ 0123456789.eE+-tfnrulasu', max_size=14))
def test_scanner_agrees_with_json_on_arbitrary_text(text: str) -> None:
    scanner = JsonPrefixScanner()
    accepted = all(scanner.push(char) for char in text) and scanner.finish()

    def refuse(name: str) -> None:
        raise ValueError(name)

    try:
        json.loads(text, parse_constant=refuse)
        valid = bool(text.strip())
    except ValueError:
        valid = False
    assert accepted == valid, text
