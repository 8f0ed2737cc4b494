"""Finding markers (`<tool_call>`, `</think>`) in text that arrives in pieces.

A marker may be cut anywhere between two pieces, so a tail that could still grow into
one is held back until the next piece shows whether it does; nothing else is held.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_trigger(text: str, start: int, triggers: Sequence[str], final: bool) -> tuple[int, str | None]:
    """Where content ends in text[start:], and the trigger found there (None: none yet).

    Without a trigger, content ends before the longest tail that could still grow into
    one, unless the output is final."""
    found = [(position, trigger) for trigger in triggers if (position := text.find(trigger, start)) >= 0]
    if found:
        position, trigger = min(found, key=lambda item: (item[0], -len(item[1])))
        return position, trigger
    if final:
        return len(text), None
    return len(text) - held_tail(text, start, triggers), None


def held_tail(text: str, start: int, markers: Sequence[str]) -> int:
    """Length of the longest tail of text[start:] that is a proper prefix of one of the markers."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text) - start), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest
