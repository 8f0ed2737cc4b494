"""Incremental detokenization and stop strings, for one generated sequence.

Decoding a growing id list piece by piece is subtle: a token may be half of a UTF-8
character, and SentencePiece-style tokenizers drop a leading space when a piece is
decoded alone. So we decode a short window that starts a few tokens back, and emit only
the text past what that window already produced, holding back an incomplete character.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

# Enough context for any tokenizer to join the next piece the way the full text would.
_WINDOW = 6


def decode_text(tokenizer: PreTrainedTokenizerBase, token_ids: list[int], skip_special_tokens: bool = False) -> str:
    """One sequence of ids as text (transformers types `decode` for a batch of sequences too)."""
    text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)
    return text


@dataclass
class StopMatch:
    """Where a stop string ended the text."""

    stop: str
    text: str  # the final text, cut at (or just after) the stop string


@dataclass
class IncrementalDetokenizer:
    """Turns a sequence's token ids into text as they arrive."""

    tokenizer: PreTrainedTokenizerBase
    skip_special_tokens: bool = True
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = 0  # stop strings count only once more tokens than this exist
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    _prefix_offset: int = 0
    _read_offset: int = 0

    def _decode(self, ids: list[int]) -> str:
        return decode_text(self.tokenizer, ids, self.skip_special_tokens)

    def add_tokens(self, new_token_ids: list[int]) -> tuple[str, StopMatch | None]:
        """Append tokens; return the newly final text and a stop match if one occurred."""
        before = len(self.text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            prefix = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            full = self._decode(self.token_ids[self._prefix_offset :])
            if full.endswith("\ufffd") or len(full) <= len(prefix):
                continue  # an incomplete character, or nothing visible yet
            self.text += full[len(prefix) :]
            self._read_offset = len(self.token_ids)
            self._prefix_offset = max(0, self._read_offset - _WINDOW)
        match = self._find_stop(before)
        if match is not None:
            self.text = match.text
        return self.text[before:], match

    def _find_stop(self, new_text_start: int) -> StopMatch | None:
        if not self.stop or len(self.token_ids) <= self.min_tokens:
            return None
        longest = max(len(s) for s in self.stop)
        search_from = max(0, new_text_start - longest + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        end = at + len(stop) if self.include_stop_str_in_output else at
        return StopMatch(stop, self.text[:end])

    def held_back(self) -> int:
        """How many trailing characters streaming must hold: a stop string may start there."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        for size in range(min(len(self.text), max(len(s) for s in self.stop) - 1), 0, -1):
            tail = self.text[-size:]
            if any(s.startswith(tail) for s in self.stop):
                return size
        return 0
