"""Tokenization that cannot stall the event loop.

The Rust tokenizer holds the GIL while it encodes, so a thread would not help: a prompt
of a few hundred thousand characters would freeze every stream and /health for a second.
Texts up to `INLINE_CHARS` are encoded in place (a few milliseconds); longer ones go to a
small pool of processes, each holding its own copy of the tokenizer (the `tokenizers`
library alone, rebuilt from its serialized form: no torch, no transformers).
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from tokenizers import Tokenizer

from cadence.engine.process_name import TOKENIZER, name_this_process

logger = logging.getLogger(__name__)

# Longer texts are encoded in the pool; this many characters encode in milliseconds.
INLINE_CHARS = 8192

_worker_tokenizer: Tokenizer | None = None


def _start_worker(tokenizer_json: str) -> None:
    global _worker_tokenizer
    name_this_process(TOKENIZER)
    _worker_tokenizer = Tokenizer.from_str(tokenizer_json)


def _encode_in_worker(text: str, add_special_tokens: bool) -> list[int]:
    assert _worker_tokenizer is not None
    return _worker_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids


def pool_size() -> int:
    """Half the usable cores, at least one and at most four: the engine needs the rest."""
    return max(1, min(4, len(os.sched_getaffinity(0)) // 2))


class TokenizePool:
    """Encodes with one tokenizer: short texts in place, long ones in worker processes.

    Both paths run the same Rust tokenizer, so a text gets the same ids either way.
    Workers start on the first long text and live until `close()`.
    """

    def __init__(self, tokenizer: Tokenizer, workers: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.json = tokenizer.to_str()
        self.workers = workers or pool_size()
        self._pool: ProcessPoolExecutor | None = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_start_worker,
                initargs=(self.json,),
            )
        return self._pool

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        if len(text) <= INLINE_CHARS:
            return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._executor(), _encode_in_worker, text, add_special_tokens)
        except BrokenProcessPool:
            # A worker died (killed, out of memory): start a new pool and try once more.
            logger.warning("a tokenizer worker died; starting new ones")
            self.close()
            return await loop.run_in_executor(self._executor(), _encode_in_worker, text, add_special_tokens)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
