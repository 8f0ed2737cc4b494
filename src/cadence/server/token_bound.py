"""The fewest tokens a text can become, known from its length alone, before tokenizing it.

Tokenizing megabytes of text takes seconds, only to refuse a prompt the context could
never hold. A tokenizer whose pipeline never drops characters bounds how many characters
one token can stand for: its longest vocabulary entry, times how much its normalizer can
shrink a text. A text longer than that many characters per context token is refused at
once. Characters that become no token at all (control bytes a byte-level vocabulary has
no entry for) are not counted. Pipelines that can drop characters beyond those
(whitespace splitting, accent stripping, fused or missing unknowns, added tokens that
strip whitespace) give no bound; their prompts are only tokenized off the event loop.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

# Canonical composition joins at most this many code points into one (the longest
# canonical decompositions, such as U+1F82, have four).
_COMPOSITION_SHRINK = 4
_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
# Pre-tokenizers that split without removing anything.
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits")
_SPLITTING_PRE_TOKENIZERS = ("Split", "Punctuation")


def _normalizer_shrink(normalizer: dict[str, Any] | None) -> float | None:
    """How many times shorter normalization can make a text; None when unbounded."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind in _UNICODE_FORMS:
        return float(_COMPOSITION_SHRINK)
    if kind in ("Prepend", "Lowercase"):
        return 1.0  # they add, or map each character to one or more
    if kind == "Replace":
        pattern = normalizer.get("pattern", {})
        if "String" not in pattern:
            return None  # a regex may match any length
        content = normalizer.get("content", "")
        return None if not content else max(1.0, len(pattern["String"]) / len(content))
    if kind == "Sequence":
        shrink = 1.0
        for inner in normalizer.get("normalizers", []):
            step = _normalizer_shrink(inner)
            if step is None:
                return None
            shrink *= step
        return shrink
    return None


def _pre_tokenizer_keeps_everything(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind in _KEEPING_PRE_TOKENIZERS:
        return True
    if kind in _SPLITTING_PRE_TOKENIZERS:
        return pre_tokenizer.get("behavior") != "Removed"
    if kind == "Sequence":
        return all(_pre_tokenizer_keeps_everything(p) for p in pre_tokenizer.get("pretokenizers", []))
    return False


def _has_byte_level(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return False
    if pre_tokenizer.get("type") == "ByteLevel":
        return True
    return any(_has_byte_level(p) for p in pre_tokenizer.get("pretokenizers", []))


def _byte_level_spelling() -> dict[int, str]:
    """Each byte's character in a byte-level vocabulary (GPT-2's mapping, as `tokenizers` uses)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def _vanishing_characters(spec: dict[str, Any]) -> frozenset[str] | None:
    """The characters that become no token at all, or None when that set cannot be known.

    Every other character becomes at least one token of its own.
    """
    model = spec["model"]
    vocab = model.get("vocab", {})
    # An unknown character becomes the unknown token, one per character, if there is one
    # and runs of them are not fused into a single token.
    if model.get("unk_token") in vocab and not model.get("fuse_unk"):
        return frozenset()
    if model.get("byte_fallback") and all(f"<0x{byte:02X}>" in vocab for byte in range(256)):
        return frozenset()
    if _has_byte_level(spec.get("pre_tokenizer")):
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
            return None  # a character inside a word is looked up with the affix, not as itself
        missing = [b for b, char in _byte_level_spelling().items() if char not in vocab]
        # A character of several bytes always has a continuation byte (0x80-0xBF); if
        # those all have entries, only one-byte (ASCII) characters can vanish.
        if any(0x80 <= b <= 0xBF for b in missing):
            return None
        return frozenset(chr(b) for b in missing if b < 0x80)
    return None


@dataclass(frozen=True)
class TokenBound:
    """The fewest tokens any text can become: its characters that do not vanish, over the
    most characters one token can stand for."""

    chars_per_token: float
    vanishing: frozenset[str]  # characters that become no token (control bytes without an entry)

    def min_tokens(self, text: str) -> int:
        counted = len(text) - sum(text.count(char) for char in self.vanishing)
        return math.ceil(counted / self.chars_per_token)

    def proves_at_least(self, text: str, limit: int) -> int | None:
        """`min_tokens(text)` when it reaches `limit`, else None. Only a text whose length
        alone reaches it pays for counting the vanishing characters."""
        if len(text) / self.chars_per_token < limit:
            return None
        least = self.min_tokens(text)
        return least if least >= limit else None


def token_bound(tokenizer_json: str) -> TokenBound | None:
    """The tokenizer's bound, or None when its pipeline lets a text shrink without limit.

    `tokenizer_json` is the tokenizer's serialized form (`Tokenizer.to_str()`).
    """
    spec = json.loads(tokenizer_json)
    if spec.get("model", {}).get("type") != "BPE":
        return None
    vanishing = _vanishing_characters(spec)
    added = spec.get("added_tokens", [])
    # An added token that strips the whitespace around it swallows any run of it.
    if vanishing is None or any(token.get("lstrip") or token.get("rstrip") for token in added):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps_everything(spec.get("pre_tokenizer")):
        return None
    if vanishing and spec.get("normalizer") is not None:
        return None  # a normalizer may turn counted characters into vanishing ones
    # Byte-level entries spell each UTF-8 byte as one character, so an entry is never
    # shorter than the characters it covers; a byte-fallback entry (<0x41>) is longer.
    longest = max((len(piece) for piece in spec["model"].get("vocab", {})), default=1)
    longest = max([longest, *(len(token.get("content", "")) for token in added)])
    return TokenBound(shrink * longest, vanishing)
