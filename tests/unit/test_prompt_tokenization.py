"""How the server tokenizes prompts: the length bound that refuses a prompt before
tokenizing it, and the pool that keeps long texts off the event loop."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable

import pytest
from tokenizers import AddedToken, Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerBase

from cadence.server.token_bound import TokenBound, token_bound
from cadence.server.tokenize_pool import INLINE_CHARS, TokenizePool
from cadence.tokenization.loading import load_tokenizer
from tests.support.helpers import needs_smollm2, smollm2_path


def _tokenizer(path: str) -> PreTrainedTokenizerBase:
    tokenizer = load_tokenizer(path)
    assert tokenizer is not None
    return tokenizer


def _random_texts(seed: int) -> list[str]:
    rng = random.Random(seed)
    alphabets = [
        "abcdefghijklmnopqrstuvwxyz ",
        " \n\t",  # whitespace runs, which byte-level vocabularies merge into long tokens
        "-=_*#",
        "éèüñçßøå中文字🎉",
        "0123456789",
    ]
    texts = []
    for _ in range(60):
        alphabet = rng.choice(alphabets) + rng.choice(alphabets)
        texts.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3000))))
    texts += ["-" * 5000, " " * 5000, "\n" * 3000, "<|im_start|>" * 50, "=" * 4000]
    # Control characters a byte-level vocabulary may have no entry for: they vanish.
    texts += ["\x04" * 3000, "a\x04\x06\x13" * 1000, "".join(chr(c) for c in range(32)) * 100]
    return texts


@pytest.mark.parametrize("which", ["tiny", pytest.param("smollm2", marks=needs_smollm2)])
def test_bound_never_exceeds_the_real_token_count(which: str, tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama") if which == "tiny" else smollm2_path()
    backend = _tokenizer(path).backend_tokenizer
    bound = token_bound(backend.to_str())
    assert bound is not None
    for text in _random_texts(seed=len(which)):
        for add_special_tokens in (True, False):
            count = len(backend.encode(text, add_special_tokens=add_special_tokens).ids)
            assert bound.min_tokens(text) <= count, (text[:40], count, bound)
    # And it is tight enough to matter: ten megabytes are far beyond any context.
    assert bound.min_tokens("x" * 10_000_000) > 100_000


def _per_token(tokenizer_json: str) -> float | None:
    bound = token_bound(tokenizer_json)
    return None if bound is None else bound.chars_per_token


def _with(
    normalizer: normalizers.Normalizer | None = None,
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = None,
    unk: bool = True,
    **model: object,
) -> str:
    vocab = {"a": 0, "ab": 1, "abcd": 2, "b": 3, "<unk>": 4}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")], unk_token="<unk>" if unk else None, **model))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer.to_str()


def test_bound_follows_the_pipeline() -> None:
    # The longest entry, <unk>, has five characters.
    assert _per_token(_with()) == 5
    assert _per_token(_with(pre_tokenizer=pre_tokenizers.ByteLevel())) == 5
    # A Unicode normal form can join up to four code points into one.
    assert _per_token(_with(normalizers.NFC())) == 20
    assert _per_token(_with(normalizers.Sequence([normalizers.Prepend("_"), normalizers.NFKC()]))) == 20
    assert _per_token(_with(normalizers.Replace("  ", " "))) == 10
    assert _per_token(_with(pre_tokenizer=pre_tokenizers.Split(" ", behavior="isolated"))) == 5
    # Pipelines that can drop characters give no bound at all.
    assert _per_token(_with(normalizers.StripAccents())) is None
    assert _per_token(_with(normalizers.Replace(" ", ""))) is None
    assert _per_token(_with(pre_tokenizer=pre_tokenizers.Whitespace())) is None
    assert _per_token(_with(pre_tokenizer=pre_tokenizers.Split(" ", behavior="removed"))) is None
    # Unknown characters that vanish (no unknown token), or fuse into one.
    assert _per_token(_with(unk=False)) is None
    assert _per_token(_with(fuse_unk=True)) is None
    assert _per_token(_with(unk=False, byte_fallback=True)) is None  # no <0xNN> entries
    # Byte-level without an unknown token: bytes without an entry vanish, and only
    # one-byte characters may be among them.
    assert _per_token(_with(pre_tokenizer=pre_tokenizers.ByteLevel(), unk=False)) is None
    assert TokenBound(2.0, frozenset("\x04")).min_tokens("ab\x04\x04\x04cd") == 2


def _byte_level(normalizer: normalizers.Normalizer | None = None, **model: object) -> str:
    """A byte-level BPE with an entry for every byte but 0x04 (as SmolLM2 lacks a few)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: i for i, char in enumerate(c for c in alphabet if c != "\u0104")}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], **model))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    return tokenizer.to_str()


def test_bound_on_byte_level_vocabularies() -> None:
    bound = token_bound(_byte_level())
    assert bound is not None and bound.vanishing == frozenset("\x04")
    assert len(Tokenizer.from_str(_byte_level()).encode("\x04" * 100).ids) == 0 == bound.min_tokens("\x04" * 100)
    # A word's inner characters are looked up with an affix the vocabulary may lack.
    assert token_bound(_byte_level(continuing_subword_prefix="##")) is None
    assert token_bound(_byte_level(end_of_word_suffix="</w>")) is None
    # A normalizer might map counted characters onto vanishing ones.
    assert token_bound(_byte_level(normalizers.Replace("x", "\x04"))) is None
    # UnicodeScripts drops leading spaces.
    assert _per_token(_with(pre_tokenizer=pre_tokenizers.UnicodeScripts())) is None


def test_bound_refuses_whitespace_stripping_added_tokens() -> None:
    """An added token with lstrip takes any run of spaces before it into itself."""
    tokenizer = Tokenizer.from_str(_with())
    tokenizer.add_special_tokens([AddedToken("<|end|>", lstrip=True)])
    assert len(tokenizer.encode(" " * 10_000 + "<|end|>").ids) < 10
    assert token_bound(tokenizer.to_str()) is None


def test_pool_encodes_whole_prompts_despite_a_truncation_setting(tiny_model_dir: Callable[[str], str]) -> None:
    tokenizer = _tokenizer(tiny_model_dir("llama"))
    backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    backend.enable_truncation(8)  # as a tokenizer.json may carry it
    text = "Paris is the capital of France, and Berlin is the capital of Germany."

    async def run() -> list[list[int]]:
        pool = TokenizePool(backend)
        try:
            return [await pool.encode(t, True) for t in (text, text * 500)]
        finally:
            pool.close()

    short, long = asyncio.run(run())
    assert short == tokenizer.encode(text, add_special_tokens=True) and len(short) > 8
    assert long == tokenizer.encode(text * 500, add_special_tokens=True)


def test_pool_keeps_split_special_tokens(tiny_model_dir: Callable[[str], str]) -> None:
    """A model that splits special tokens written in the text keeps doing so in the pool."""
    tokenizer = _tokenizer(tiny_model_dir("llama"))
    tokenizer.backend_tokenizer.encode_special_tokens = True
    text = "<|im_start|>user hello"

    async def run() -> list[int]:
        pool = TokenizePool(tokenizer.backend_tokenizer)
        try:
            return await pool.encode(text, False)
        finally:
            pool.close()

    ids = asyncio.run(run())
    assert ids == tokenizer.backend_tokenizer.encode(text, add_special_tokens=False).ids
    assert tokenizer.convert_tokens_to_ids("<|im_start|>") not in ids


def test_pool_keeps_the_event_loop_turning(tiny_model_dir: Callable[[str], str]) -> None:
    tokenizer = _tokenizer(tiny_model_dir("llama"))
    long_text = "The quick brown fox jumps over the lazy dog. " * 16000
    assert len(long_text) > INLINE_CHARS

    async def run() -> tuple[list[list[int]], list[float], float]:
        pool = TokenizePool(tokenizer.backend_tokenizer)
        gaps: list[float] = []
        done = False

        async def tick() -> None:
            last = time.perf_counter()
            while not done:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        started = time.perf_counter()
        try:
            results = [await pool.encode(long_text, special) for special in (True, False)]
            results.append(await pool.encode("short", True))
        finally:
            took = time.perf_counter() - started
            done = True
            await ticker
            pool.close()
        return results, gaps, took

    (with_special, without, short), gaps, took = asyncio.run(run())
    assert with_special == tokenizer.encode(long_text, add_special_tokens=True)
    assert without == tokenizer.encode(long_text, add_special_tokens=False)
    assert short == tokenizer.encode("short", add_special_tokens=True)
    # Encoding 1.4M characters took a while, and the loop kept turning all along: encoded on
    # the loop, the ticker would get a turn only between the three encodes.
    assert took > 0.3, took
    assert len(gaps) >= 10, gaps
