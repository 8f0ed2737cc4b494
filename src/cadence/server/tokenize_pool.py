"""Tokenization that cannot stall the event loop.

The Rust tokenizer releases the GIL in its batch calls (`encode_batch`) and holds it in
the single ones, so every text is encoded through the batch call: long ones on a small
thread pool, where a prompt of megabytes takes its seconds on another core while streams
and /health go on; short ones in place, where a thread hop would cost more than the work.
Other prompt work that may be long (a chat template over big messages, decoding a long
list of ids) runs on the same pool through `run`.

The pool encodes with a copy of the tokenizer whose truncation and padding are off, as
transformers' `encode` switches them off: a tokenizer.json that carries a truncation
setting must not cut a prompt short. The copy keeps whether special tokens written in
the text are split (transformers' `split_special_tokens`), which the serialized form
does not carry.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from tokenizers import Tokenizer

# Shorter texts are encoded in place: this many characters take a few milliseconds.
INLINE_CHARS = 8192

T = TypeVar("T")


def pool_size() -> int:
    """Half the usable cores, at least one and at most four: the engine needs the rest."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 2))


class TokenizePool:
    """Encodes with one tokenizer, off the event loop whenever the text is long."""

    def __init__(self, tokenizer: Tokenizer, workers: int | None = None) -> None:
        self.tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        # Not part of the serialized form: transformers' split_special_tokens lives here.
        self.tokenizer.encode_special_tokens = tokenizer.encode_special_tokens
        self.json = self.tokenizer.to_str()
        self._executor = ThreadPoolExecutor(workers or pool_size(), thread_name_prefix="cadence-tokenize")

    def encode_now(self, text: str, add_special_tokens: bool) -> list[int]:
        """Encode on the calling thread (the GIL is released while the tokenizer works)."""
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.encode_now(text, add_special_tokens)
        return await self.run(self.encode_now, text, add_special_tokens)

    async def run(self, function: Callable[..., T], *args: object) -> T:
        """Run `function(*args)` on the pool's threads."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, function, *args)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
