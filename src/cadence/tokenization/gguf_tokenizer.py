"""Rebuild a Hugging Face fast tokenizer from the tokenizer metadata inside a GGUF file.

A GGUF carries no tokenizer.json, only llama.cpp's description of one: the token list,
their types, BPE merges (byte-level vocabularies) or scores (SentencePiece vocabularies),
the special token ids and the chat template. We build the `tokenizers` pipeline ourselves
rather than through transformers' GGUF helpers: their module path and signatures changed
between transformers 4.x and 5.x (we support both), and they quietly fall back to GPT-2's
split for a `tokenizer.ggml.pre` they do not know, where llama.cpp refuses the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

_KEY = "tokenizer.ggml."

# The tiktoken-style split that Llama 3 vocabularies were trained with.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _gpt2_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _digits_then_gpt2_split() -> pre_tokenizers.PreTokenizer:
    # llama.cpp splits every digit off on its own before GPT-2's regex for these
    # vocabularies (StarCoder's lineage, which SmolLM2 follows).
    return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _gpt2_split()])


def _llama3_split() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


# `tokenizer.ggml.pre` -> (pre-tokenizer, ignore_merges). llama.cpp refuses a `pre` it does
# not know, and so do we: a wrong split silently changes token ids. "default" is what
# llama.cpp assumes for byte-level files written before `pre` existed; GPT-2's regex is
# the closest split `tokenizers` offers.
_PRE_TOKENIZERS: dict[str, tuple[Callable[[], pre_tokenizers.PreTokenizer], bool]] = {
    "gpt-2": (_gpt2_split, False),
    "default": (_gpt2_split, False),
    "smollm": (_digits_then_gpt2_split, False),
    "starcoder": (_digits_then_gpt2_split, False),
    # Llama 3 looks a whole pre-token up in the vocabulary before merging.
    "llama-bpe": (_llama3_split, True),
    "llama3": (_llama3_split, True),
    "smaug-bpe": (_llama3_split, True),
}


def _special_token(metadata: Mapping[str, Any], tokens: Sequence[str], name: str) -> str | None:
    token_id = metadata.get(f"{_KEY}{name}_token_id")
    if token_id is None or not 0 <= int(token_id) < len(tokens):
        return None
    return tokens[int(token_id)]


def _byte_level_model(metadata: Mapping[str, Any], tokens: Sequence[str]) -> Tokenizer:
    pre = str(metadata.get(f"{_KEY}pre", "default"))
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(
            f"GGUF byte-level tokenizer with pre-tokenizer {pre!r} is not supported; "
            f"supported: {', '.join(sorted(_PRE_TOKENIZERS))}"
        )
    make_pre, ignore_merges = _PRE_TOKENIZERS[pre]
    merges = []
    for merge in metadata.get(f"{_KEY}merges") or []:
        left, _, right = str(merge).partition(" ")  # byte-level pieces never hold a space
        merges.append((left, right))
    vocab = {token: index for index, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab, merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = make_pre()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_merges(
    tokens: Sequence[str], scores: Sequence[float], types: Sequence[int]
) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary.

    SentencePiece BPE merges the adjacent pair whose joined piece scores highest, so every
    split of a normal piece into two known normal pieces is a merge ranked by that score.
    """
    mergeable = {token: index for index, (token, kind) in enumerate(zip(tokens, types)) if kind == TokenType.NORMAL}
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, index in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for _, _, _, left, right in ranked]


def _sentencepiece_model(metadata: Mapping[str, Any], tokens: Sequence[str], types: Sequence[int]) -> Tokenizer:
    scores = [float(s) for s in metadata.get(f"{_KEY}scores") or [0.0] * len(tokens)]
    unk = _special_token(metadata, tokens, "unknown")
    vocab = {token: index for index, token in enumerate(tokens)}
    merges = _sentencepiece_merges(tokens, scores, types)
    tokenizer = Tokenizer(models.BPE(vocab, merges, unk_token=unk, fuse_unk=True, byte_fallback=True))
    # Like SentencePiece, llama.cpp puts one space before every run of text that starts the
    # input or follows a special token, even one that already starts with a space (" hi"
    # -> "\u2581\u2581hi"). A normalizer does exactly that: it sees each run between added tokens.
    # (Metaspace would not add a second space.)
    add_space = bool(metadata.get(f"{_KEY}add_space_prefix", True))
    to_meta = normalizers.Replace(" ", "\u2581")
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), to_meta]) if add_space else to_meta
    steps: list[decoders.Decoder] = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _post_processor(
    metadata: Mapping[str, Any], bos: str | None, eos: str | None, vocab: Mapping[str, int], default_bos: bool
) -> processors.PostProcessor | None:
    """Add BOS/EOS around encoded text as the file's add_bos/add_eos flags say."""
    prefix = [bos] if bos is not None and metadata.get(f"{_KEY}add_bos_token", default_bos) else []
    suffix = [eos] if eos is not None and metadata.get(f"{_KEY}add_eos_token", False) else []
    if not prefix and not suffix:
        return None
    single = " ".join([*prefix, "$A", *suffix])
    pair = " ".join([*prefix, "$A", *suffix, *prefix, "$B:1", *suffix])
    special = [(token, vocab[token]) for token in dict.fromkeys(prefix + suffix)]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special)


def build_tokenizer(metadata: Mapping[str, Any]) -> PreTrainedTokenizerFast:
    """A fast tokenizer equivalent to llama.cpp's reading of this GGUF metadata.

    `metadata` maps GGUF keys (e.g. "tokenizer.ggml.tokens") to plain Python values.
    Supports byte-level BPE ("gpt2") and SentencePiece BPE ("llama") vocabularies.
    """
    tokens = [str(t) for t in metadata.get(f"{_KEY}tokens") or []]
    if not tokens:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens; cannot build a tokenizer")
    types = [int(t) for t in metadata.get(f"{_KEY}token_type") or [TokenType.NORMAL] * len(tokens)]
    kind = metadata.get(f"{_KEY}model")
    if kind == "gpt2":
        tokenizer = _byte_level_model(metadata, tokens)
    elif kind == "llama":
        tokenizer = _sentencepiece_model(metadata, tokens, types)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; supported: gpt2, llama")

    # Control tokens (<|im_start|>, <s>) must match whole and be skippable when decoding;
    # user-defined ones match whole but are ordinary text. Both already have vocab ids.
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == TokenType.CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == TokenType.USER_DEFINED]
    )

    bos = _special_token(metadata, tokens, "bos")
    eos = _special_token(metadata, tokens, "eos")
    pad = _special_token(metadata, tokens, "padding")
    unk = _special_token(metadata, tokens, "unknown")
    # SentencePiece files that predate the add_bos flag expect a BOS; byte-level ones do not.
    post = _post_processor(metadata, bos, eos, tokenizer.get_vocab(), default_bos=kind == "llama")
    if post is not None:
        tokenizer.post_processor = post

    options: dict[str, Any] = {
        "tokenizer_object": tokenizer,
        "bos_token": bos,
        "eos_token": eos,
        # Batch padding needs a pad token; EOS is the usual stand-in when the file has none.
        "pad_token": pad if pad is not None else eos,
        "unk_token": unk,
        # transformers 4.x would otherwise rewrite " ." as "." when decoding.
        "clean_up_tokenization_spaces": False,
    }
    template = metadata.get("tokenizer.chat_template")
    if template:
        options["chat_template"] = str(template)
    context = metadata.get(f"{metadata.get('general.architecture', 'llama')}.context_length")
    if context:
        options["model_max_length"] = int(context)
    return PreTrainedTokenizerFast(**{k: v for k, v in options.items() if v is not None})


def save_tokenizer(metadata: Mapping[str, Any], folder: str | os.PathLike[str]) -> None:
    """Write the tokenizer described by GGUF `metadata` into `folder` (tokenizer.json etc.)."""
    folder = os.fspath(folder)
    build_tokenizer(metadata).save_pretrained(folder)
    # transformers 5 records its own class name, which 4.x cannot load; this name loads
    # the same tokenizer.json in both, so a cache folder outlives a transformers upgrade.
    config_path = os.path.join(folder, "tokenizer_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
