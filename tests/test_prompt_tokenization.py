"""How the server tokenizes prompts: the length bound that refuses a prompt before
tokenizing it, and the pool that keeps long texts off the event loop."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Callable

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
from transformers import PreTrainedTokenizerBase

from cadence.engine.llm import load_tokenizer
from cadence.engine.process_name import TOKENIZER
from cadence.server.token_bound import chars_per_token_bound, min_tokens
from cadence.server.tokenize_pool import INLINE_CHARS, TokenizePool
from helpers import needs_smollm2, smollm2_path


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
    return texts


@pytest.mark.parametrize("which", ["tiny", pytest.param("smollm2", marks=needs_smollm2)])
def test_bound_never_exceeds_the_real_token_count(which: str, tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama") if which == "tiny" else smollm2_path()
    backend = _tokenizer(path).backend_tokenizer
    per_token = chars_per_token_bound(backend.to_str())
    assert per_token is not None
    for text in _random_texts(seed=len(which)):
        for add_special_tokens in (True, False):
            count = len(backend.encode(text, add_special_tokens=add_special_tokens).ids)
            assert min_tokens(len(text), per_token) <= count, (text[:40], count, per_token)
    # And it is tight enough to matter: ten megabytes are far beyond any context.
    assert min_tokens(10_000_000, per_token) > 100_000


def _with(normalizer: normalizers.Normalizer | None, pre_tokenizer: pre_tokenizers.PreTokenizer | None) -> str:
    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "ab": 1, "abcd": 2, "b": 3}, merges=[("a", "b")]))
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    if pre_tokenizer is not None:
        tokenizer.pre_tokenizer = pre_tokenizer
    return tokenizer.to_str()


def test_bound_follows_the_pipeline() -> None:
    assert chars_per_token_bound(_with(None, pre_tokenizers.ByteLevel())) == 4
    # A Unicode normal form can join up to four code points into one.
    assert chars_per_token_bound(_with(normalizers.NFC(), None)) == 16
    assert (
        chars_per_token_bound(_with(normalizers.Sequence([normalizers.Prepend("_"), normalizers.NFKC()]), None)) == 16
    )
    assert chars_per_token_bound(_with(normalizers.Replace("  ", " "), None)) == 8
    # Pipelines that drop characters give no bound at all.
    assert chars_per_token_bound(_with(normalizers.StripAccents(), None)) is None
    assert chars_per_token_bound(_with(normalizers.Replace(" ", ""), None)) is None
    assert chars_per_token_bound(_with(None, pre_tokenizers.Whitespace())) is None
    assert chars_per_token_bound(_with(None, pre_tokenizers.Split(" ", behavior="removed"))) is None
    assert chars_per_token_bound(_with(None, pre_tokenizers.Split(" ", behavior="isolated"))) == 4
    fused = json.loads(_with(None, None))
    fused["model"]["fuse_unk"] = True
    assert chars_per_token_bound(json.dumps(fused)) is None
    assert min_tokens(10**6, None) == 0


def test_pool_gives_the_inline_ids_from_another_process(tiny_model_dir: Callable[[str], str]) -> None:
    tokenizer = _tokenizer(tiny_model_dir("llama"))
    backend = tokenizer.backend_tokenizer
    long_text = "The quick brown fox jumps over the lazy dog. " * 2000
    assert len(long_text) > INLINE_CHARS

    async def run() -> tuple[list[list[int]], list[float]]:
        pool = TokenizePool(backend, workers=1)
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
        try:
            await pool.encode("warm the worker up" * 1000, True)
            gaps.clear()
            results = [await pool.encode(long_text * 8, special) for special in (True, False)]
            results.append(await pool.encode("short", True))
        finally:
            done = True
            await ticker
            pool.close()
        return results, gaps

    (with_special, without, short), gaps = asyncio.run(run())
    assert with_special == tokenizer.encode(long_text * 8, add_special_tokens=True)
    assert without == tokenizer.encode(long_text * 8, add_special_tokens=False)
    assert short == tokenizer.encode("short", add_special_tokens=True)
    # The event loop kept turning while the worker encoded 700k characters.
    assert max(gaps) < 0.25, max(gaps)


def test_pool_worker_is_named_and_replaced_when_it_dies(tiny_model_dir: Callable[[str], str]) -> None:
    backend = _tokenizer(tiny_model_dir("llama")).backend_tokenizer
    text = "Paris is the capital of France. " * 1000

    async def run() -> list[int]:
        pool = TokenizePool(backend, workers=1)
        try:
            first = await pool.encode(text, False)
            assert pool._pool is not None
            (pid,) = [p.pid for p in pool._pool._processes.values()]
            assert pid is not None
            with open(f"/proc/{pid}/comm", encoding="ascii") as comm:
                assert comm.read().strip() == TOKENIZER
            os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.5)
            again = await pool.encode(text, False)
            assert again == first
            return again
        finally:
            pool.close()

    assert asyncio.run(run()) == backend.encode(text, add_special_tokens=False).ids
