"""The fewest tokens a text can become, known from its length alone, before tokenizing it.

Tokenizing megabytes of text takes seconds, only to refuse a prompt the context could
never hold. A tokenizer whose pipeline never drops characters bounds how many characters
one token can stand for: its longest vocabulary entry, times how much its normalizer can
shrink a text. A text longer than that many characters per context token is refused at
once. Pipelines that can drop characters (whitespace splitting, accent stripping, fused
unknowns) give no bound; their prompts are only tokenized away from the event loop.
"""

from __future__ import annotations

import json
import math
from typing import Any

# Canonical composition joins at most this many code points into one (the longest
# canonical decompositions, such as U+1F82, have four).
_COMPOSITION_SHRINK = 4
_UNICODE_FORMS = ("NFC", "NFD", "NFKC", "NFKD")
# Pre-tokenizers that split without removing anything.
_KEEPING_PRE_TOKENIZERS = ("ByteLevel", "Metaspace", "Digits", "UnicodeScripts")
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


def chars_per_token_bound(tokenizer_json: str) -> float | None:
    """The most characters of raw text one token can stand for, or None when no bound holds.

    `tokenizer_json` is the tokenizer's serialized form (`Tokenizer.to_str()`).
    """
    spec = json.loads(tokenizer_json)
    model = spec.get("model", {})
    if model.get("type") != "BPE":
        return None
    # Without byte fallback an unknown character becomes the unknown token, and fused
    # unknowns make one token of any run of them.
    if model.get("fuse_unk") and not model.get("byte_fallback"):
        return None
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _pre_tokenizer_keeps_everything(spec.get("pre_tokenizer")):
        return None
    # Byte-level entries spell each UTF-8 byte as one character, so an entry is never
    # shorter than the characters it covers; a byte-fallback entry (<0x41>) is longer.
    longest = max((len(piece) for piece in model.get("vocab", {})), default=1)
    longest = max([longest, *(len(t.get("content", "")) for t in spec.get("added_tokens", []))])
    return shrink * longest


def min_tokens(num_chars: int, chars_per_token: float | None) -> int:
    """The fewest tokens `num_chars` characters can become (0 when nothing is known)."""
    if chars_per_token is None:
        return 0
    return math.ceil(num_chars / chars_per_token)
