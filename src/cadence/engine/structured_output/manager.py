"""The engine's grammars: compiled off the loop, cached, and one matcher per sequence.

A constrained request is held here, out of the scheduler, until its grammar is compiled,
so it never holds up the others; the engine asks `take_ready` each step. Compiling runs
on a small thread pool (llguidance drops the GIL), cached by the constraint's cache key:
each sequence gets a copy of the cached matcher. A grammar that fails, or takes longer
than the compile timeout, fails its request with the reason. The timeout counts from
when its compile starts (or the request arrives, if later): time queued behind other
compiles on the pool does not count against it.

Each step's masks are filled on a thread while the forward pass runs (`start_masks`);
the runner joins them before sampling. After sampling, `advance` feeds each sampled
token to its matcher. A matcher first consumes whatever output tokens it has not seen:
tokens kept across a preemption need nothing, and a sequence whose tokens came from
elsewhere catches up before its next mask.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import llguidance
import torch

from cadence.engine.structured_output.bitmask import bitmask_width
from cadence.engine.structured_output.matcher import GrammarMatcher, fill_bitmasks
from cadence.scheduler.request import Request
from cadence.structured_outputs.grammar import grammar_text, ll_tokenizer, parser_limits
from cadence.structured_outputs.params import StructuredOutputsParams
from cadence.tokenization.loading import load_tokenizer

# Compiled grammars kept for reuse; a tool set or schema repeats across requests.
MAX_CACHED_GRAMMARS = 256
COMPILE_THREADS = 2


@dataclass
class GrammarMasks:
    """One step's token masks: row `rows[request_id]` of `bitmask` [K, ceil(V / 32)] int32."""

    bitmask: torch.Tensor
    rows: dict[str, int]


@dataclass
class _Held:
    """A client request's sequences, waiting for their grammar."""

    key: str
    arrived: float  # time.monotonic()
    sequences: list[Request]


class StructuredOutputManager:
    """Compiles grammars, holds requests until theirs is ready, and owns every matcher."""

    def __init__(self, model: str, vocab_size: int, eos_token_ids: Iterable[int], compile_timeout: float) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.compile_timeout = compile_timeout
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._tokenizer_lock = threading.Lock()
        self._compile_pool: ThreadPoolExecutor | None = None
        self._mask_pool: ThreadPoolExecutor | None = None
        self._mask_executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()
        self._compiling: dict[str, Future[llguidance.LLMatcher]] = {}
        self._compile_started: dict[str, float] = {}  # by key, written by the compiling thread
        self._held: dict[str, _Held] = {}  # by client request id
        self.matchers: dict[str, GrammarMatcher] = {}  # by sequence (scheduler request) id
        # Built from the start (the engine makes the manager before it loads the model),
        # so the first constrained request does not wait the second it takes.
        threading.Thread(target=self._prepare_tokenizer, name="grammar-tokenizer", daemon=True).start()

    def _prepare_tokenizer(self) -> None:
        try:
            self.tokenizer()
        except Exception:  # noqa: BLE001 - said again, to the request, when a grammar needs it
            pass

    # ----- compiling -------------------------------------------------------------------
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer for this model, built once (about a second)."""
        with self._tokenizer_lock:
            if self._tokenizer is None:
                hf_tokenizer = load_tokenizer(self.model)
                backend = getattr(hf_tokenizer, "backend_tokenizer", None)
                if backend is None:
                    raise ValueError("structured outputs need the model's fast tokenizer, and it has none")
                self._tokenizer = ll_tokenizer(backend.to_str(), self.vocab_size, self.eos_token_ids)
            return self._tokenizer

    def _compile(self, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self.tokenizer(), grammar_text(params), limits=parser_limits(), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the grammar does not compile: {matcher.get_error()}")
        return matcher

    def hold(self, client_id: str, sequences: list[Request]) -> bool:
        """Start a request's grammar. True when it was cached, and its sequences have
        their matchers now; else they wait here until `take_ready` returns them."""
        params: StructuredOutputsParams = sequences[0].sampling_params.structured_outputs
        key = params.cache_key()
        template = self._compiled.get(key)
        if template is not None:
            self._compiled.move_to_end(key)
            self._give_matchers(template, sequences)
            return True
        if key not in self._compiling:
            if self._compile_pool is None:
                self._compile_pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar-compile")
            self._compiling[key] = self._compile_pool.submit(self._timed_compile, key, params)
        self._held[client_id] = _Held(key, time.monotonic(), sequences)
        return False

    def _timed_compile(self, key: str, params: StructuredOutputsParams) -> llguidance.LLMatcher:
        self._compile_started[key] = time.monotonic()
        return self._compile(params)

    def _deadline(self, held: _Held) -> float | None:
        """When a held request's time is up; None while its compile waits for a thread."""
        started = self._compile_started.get(held.key)
        return None if started is None else max(started, held.arrived) + self.compile_timeout

    def take_ready(self) -> tuple[list[Request], dict[str, tuple[str, list[Request]]]]:
        """Sequences whose grammar is ready (with their matchers), and the client requests
        whose grammar failed or timed out: the reason and their sequences, which are no
        longer held here (the caller forgets them)."""
        errors = self._finish_compiles()
        ready: list[Request] = []
        failed: dict[str, tuple[str, list[Request]]] = {}
        now = time.monotonic()
        for client_id, held in list(self._held.items()):
            template = self._compiled.get(held.key)
            if template is not None:
                self._give_matchers(template, held.sequences)
                ready.extend(held.sequences)
            elif held.key in errors:
                failed[client_id] = (errors[held.key], held.sequences)
            elif (deadline := self._deadline(held)) is not None and now >= deadline:
                failed[client_id] = (f"the grammar did not compile within {self.compile_timeout:g} s", held.sequences)
            else:
                continue
            del self._held[client_id]
        return ready, failed

    def _finish_compiles(self) -> dict[str, str]:
        """Cache the grammars that compiled since the last call; the others' errors by key."""
        errors: dict[str, str] = {}
        for key, future in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[key]
            self._compile_started.pop(key, None)
            error = future.exception()
            if error is not None:
                errors[key] = str(error)
                continue
            self._compiled[key] = future.result()
        self._evict()
        return errors

    def _evict(self) -> None:
        """Drop the least recently used grammars past the cache's size, never one a held
        request still waits to be given (the cache outgrows its size until then)."""
        excess = len(self._compiled) - MAX_CACHED_GRAMMARS
        if excess <= 0:
            return
        waited_for = {held.key for held in self._held.values()}
        for key in [key for key in self._compiled if key not in waited_for][:excess]:
            del self._compiled[key]

    def _give_matchers(self, template: llguidance.LLMatcher, sequences: list[Request]) -> None:
        for request in sequences:
            self.matchers[request.request_id] = GrammarMatcher(template.deep_copy())

    @property
    def num_held(self) -> int:
        """Sequences waiting for their grammar."""
        return sum(len(held.sequences) for held in self._held.values())

    def has_ready(self) -> bool:
        """Whether `take_ready` would return something now."""
        now = time.monotonic()
        return any(
            held.key not in self._compiling
            or self._compiling[held.key].done()
            or ((deadline := self._deadline(held)) is not None and now >= deadline)
            for held in self._held.values()
        )

    def wait(self) -> None:
        """Block until a held request's grammar is compiled or its time is up, or any
        compile ends (a queued one may start then, and its time with it)."""
        if not self._held or any(held.key not in self._compiling for held in self._held.values()):
            return
        deadlines = [d for held in self._held.values() if (d := self._deadline(held)) is not None]
        # A compile not started yet starts when another ends, or its thread is about to take it.
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else self.compile_timeout
        futures = list(self._compiling.values())
        concurrent.futures.wait(futures, timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def drop(self, client_id: str) -> list[Request]:
        """Stop holding a request (aborted): its sequences."""
        held = self._held.pop(client_id, None)
        return [] if held is None else held.sequences

    def forget(self, request_id: str) -> None:
        """A sequence ended: its matcher goes."""
        self.matchers.pop(request_id, None)

    # ----- decoding --------------------------------------------------------------------
    def start_masks(self, sampling: list[Request]) -> Future[GrammarMasks] | None:
        """Fill the masks of the constrained ones among `sampling` (the sequences that
        sample this step) on a thread; None when none is constrained."""
        matchers = self.matchers
        rows = [(r.request_id, matchers[r.request_id], self._unseen(r)) for r in sampling if r.request_id in matchers]
        if not rows:
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
            self._mask_executor = llguidance.LLExecutor(num_threads=max(1, min(8, (os.cpu_count() or 2) // 2)))
        return self._mask_pool.submit(self._fill_masks, rows)

    def _fill_masks(self, rows: list[tuple[str, GrammarMatcher, list[int]]]) -> GrammarMasks:
        for _, matcher, unseen in rows:
            matcher.accept(unseen)  # a refusal shows in `advance`, which fails the request
        bitmask = torch.empty((len(rows), bitmask_width(self.vocab_size)), dtype=torch.int32)
        assert self._mask_executor is not None
        fill_bitmasks(self._mask_executor, [matcher for _, matcher, _ in rows], bitmask)
        return GrammarMasks(bitmask, {request_id: i for i, (request_id, _, _) in enumerate(rows)})

    def _unseen(self, request: Request) -> list[int]:
        """The output tokens the sequence's matcher has not consumed yet."""
        return request.token_ids[request.num_prompt_tokens + self.matchers[request.request_id].num_accepted :]

    def advance(
        self, sampled: dict[str, int], requests: dict[str, Request]
    ) -> tuple[set[str], set[str], dict[str, str]]:
        """Feed each constrained sequence its sampled token (after any it has not seen).
        Returns the sequences whose grammar is now complete (they stop); those among them
        whose last token is text rather than EOS or a stop token (a grammar that may stop
        or go on, and sampled EOS, ends as any EOS ends); and those whose matcher refused
        a token, with the reason."""
        stopped: set[str] = set()
        completed_by_text: set[str] = set()
        failed: dict[str, str] = {}
        for request_id, token_id in sampled.items():
            matcher = self.matchers.get(request_id)
            request = requests.get(request_id)
            if matcher is None or request is None:
                continue
            if not matcher.accept([*self._unseen(request), token_id]):
                failed[request_id] = matcher.error or f"token {token_id} does not fit the grammar"
            elif matcher.is_terminated:
                stopped.add(request_id)
                if token_id not in self.eos_token_ids and token_id not in request.stop.stop_token_ids:
                    completed_by_text.add(request_id)
        return stopped, completed_by_text, failed

    def close(self) -> None:
        for pool in (self._compile_pool, self._mask_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
