"""The router's state machine for disaggregated requests: which engine does what, when.

One request, seen from here:

1. RESERVING: sent to a decode engine as a "load" request. The engine reserves blocks
   for the prompt, adopting its prefix-cache hits, and parks it (no compute).
2. The reservation comes back. If the prefix cache had the prompt, or the placement
   (server/disaggregation/placement.py) finds computing it here sooner and harmless, the
   decode engine is told to compute the rest itself. Otherwise PREFILLING: a prefill
   engine, the least loaded, gets a "send" request.
3. The prefill engine reports the prompt's KV computed, in which blocks. LOADING: the
   decode engine is told to read them.
4. The decode engine reports the load's outcome (complete, or how far it got; it
   computes whatever is missing). DECODING: the prefill engine frees its blocks now,
   by this acknowledgement, not by a timeout. The decode engine streams the output.

Failures never leave a request waiting: a dead prefill engine's requests are re-sent to
another prefill engine or computed on their decode engine; a dead decode engine's
requests are released on the prefill side and reported failed; a client abort reaches
both engines. The engines keep deadlines of their own (kv_wait_timeout,
kv_hold_timeout) in case a message is lost. This module only decides and sends
messages; drivers deliver them (in-process engines, or engine processes over ZMQ).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from cadence.engine.protocol import (
    AbortRequests,
    CancelKVWait,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStats,
    ExtendKVWait,
    LoadKV,
    Message,
    ReleaseKV,
)
from cadence.engine.sampling_params import SamplingParams
from cadence.server.disaggregation.placement import (
    MIN_LOCAL_CHUNK,
    DecodeLoad,
    Placement,
    PlacementPolicy,
    local_chunk,
    local_prompt_rate,
    place_prompt,
)
from cadence.server.disaggregation.transfer_stats import TransferStats, engine_rate


class Phase(enum.Enum):
    RESERVING = "reserving"
    PREFILLING = "prefilling"
    LOADING = "loading"
    DECODING = "decoding"


@dataclass
class Route:
    """Where one request is, and on which engines."""

    request: EngineCoreRequest
    decode: str
    phase: Phase = Phase.RESERVING
    prefill: str | None = None
    num_tokens_to_prefill: int = 0
    load_sent_at: float = 0.0
    # Prompt tokens its decode engine was told to compute, until its first output.
    local_tokens_pending: int = 0
    # When its decode engine last heard that the prefill engine works on (time.monotonic).
    wait_extended_at: float = 0.0


class NoEngineError(RuntimeError):
    """No live decode engine can take a request."""


class Coordinator:
    """Routes requests over prefill and decode engines and moves them through `Phase`."""

    def __init__(self, send: Callable[[str, Message], None], placement: PlacementPolicy | None = None) -> None:
        self.send = send
        self.placement = placement or PlacementPolicy()  # where prompts are computed
        self.engine_stats: dict[str, EngineStats] = {}  # each engine's latest gauges
        self.prefill: dict[str, EngineReady] = {}
        self.decode: dict[str, EngineReady] = {}
        self.routes: dict[str, Route] = {}
        self.draining: set[str] = set()  # engines finishing their work, to be given none
        self.stats = TransferStats()

    # ----- engines -------------------------------------------------------------------
    def add_engine(self, engine_id: str, ready: EngineReady) -> None:
        """Admit an engine (again) after checking its KV layout against the others'."""
        self.check_engine(engine_id, ready)
        (self.prefill if ready.kv_role == "prefill" else self.decode)[engine_id] = ready
        self.draining.discard(engine_id)

    def check_engine(self, engine_id: str, ready: EngineReady) -> None:
        """ValueError unless the engine can work with the others (its KV layout, its limits)."""
        if ready.kv_role not in ("prefill", "decode"):
            raise ValueError(f"engine {engine_id} has role {ready.kv_role!r}; a router needs prefill or decode engines")
        if ready.kv_layout is None or (ready.kv_role == "prefill" and ready.kv_source is None):
            raise ValueError(f"engine {engine_id} does not describe its KV blocks")
        if ready.kv_role == "prefill":
            self._check_deadlines(engine_id, ready, self.decode.values())
        else:
            self._check_deadlines(engine_id, ready, self.prefill.values())
        for other_id, other in {**self.prefill, **self.decode}.items():
            assert other.kv_layout is not None
            if other_id == engine_id:
                continue
            mismatch = other.kv_layout.mismatch(ready.kv_layout)
            if mismatch is not None:
                raise ValueError(f"engine {engine_id} cannot exchange KV with {other_id}: {mismatch}")
            if (ready.max_model_len, ready.vocab_size) != (other.max_model_len, other.vocab_size):
                raise ValueError(
                    f"engine {engine_id} takes max_model_len {ready.max_model_len} and vocab_size "
                    f"{ready.vocab_size}; {other_id} takes {other.max_model_len} and {other.vocab_size}"
                )

    def set_draining(self, engine_id: str, draining: bool) -> None:
        """A draining engine keeps the requests it has and gets no new ones."""
        if draining:
            self.draining.add(engine_id)
        else:
            self.draining.discard(engine_id)

    def remove_engine(self, engine_id: str) -> list[str]:
        """Forget a dead engine. Returns the requests that are lost with it (those it was
        decoding); everything else moves on without it."""
        self.engine_stats.pop(engine_id, None)
        self.draining.discard(engine_id)
        if self.prefill.pop(engine_id, None) is not None:
            for route in self.routes.values():
                if route.prefill == engine_id and route.phase is Phase.PREFILLING:
                    self._prefill_elsewhere(route, f"prefill engine {engine_id} is gone")
            return []
        self.decode.pop(engine_id, None)
        lost = [rid for rid, route in self.routes.items() if route.decode == engine_id]
        for request_id in lost:
            self._drop(self.routes[request_id])
        return lost

    # ----- requests -----------------------------------------------------------------
    def add_request(self, request: EngineCoreRequest) -> str:
        """Send a request to the least loaded decode engine; returns that engine's id."""
        open_engines = [engine for engine in self.decode if engine not in self.draining]
        if not open_engines:
            raise NoEngineError("no decode engine is available" + (" (draining)" if self.decode else ""))
        if request.request_id in self.routes:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        decode = min(open_engines, key=lambda e: (self._num_routes(e), e))
        remote = (
            self.placement.mode != "local"
            and request.sampling_params.prompt_logprobs is None
            and len(request.prompt_token_ids) > 1
        )
        self.routes[request.request_id] = Route(request, decode, Phase.RESERVING if remote else Phase.DECODING)
        self.send(decode, replace(request, remote_kv="load" if remote else None))
        if not remote:
            self.stats.num_local_prefills += 1
        return decode

    def abort(self, request_id: str) -> None:
        """The client is gone: stop the request on every engine it touches."""
        route = self.routes.get(request_id)
        if route is not None:
            self._drop(route)
            self.send(route.decode, AbortRequests([request_id]))

    def finished(self, request_id: str) -> None:
        """The decode engine finished the request (every sequence)."""
        route = self.routes.pop(request_id, None)
        if route is not None and route.phase is not Phase.DECODING:
            self._drop(route)

    # ----- what engines report ------------------------------------------------------
    def on_outputs(self, engine_id: str, outputs: EngineCoreOutputs) -> None:
        self.engine_stats[engine_id] = outputs.stats
        if engine_id in self.prefill:
            self._extend_waits(engine_id)
        for output in outputs.outputs:
            route = self.routes.get(output.request_id)
            if route is not None and route.local_tokens_pending and route.decode == engine_id:
                route.local_tokens_pending = 0  # its prompt is computed
        for reservation in outputs.kv_reserved:
            route = self.routes.get(reservation.request_id)
            if route is None or route.decode != engine_id or route.phase is not Phase.RESERVING:
                continue
            uncached = reservation.num_tokens - reservation.num_cached_tokens
            route.num_tokens_to_prefill = uncached
            if not reservation.needs_transfer:
                route.phase = Phase.DECODING
                self.stats.num_local_prefills += 1
            elif (placement := self._place(route)).local:
                self._compute_on_decode(route, placement.reason, placement.chunk_tokens)
            else:
                self._prefill_elsewhere(route, None)
        for prefilled in outputs.kv_prefilled:
            route = self.routes.get(prefilled.request_id)
            if route is not None and route.prefill == engine_id and route.phase is Phase.LOADING:
                continue  # a repeat: the decode engine is reading that KV now
            if route is None or route.prefill != engine_id or route.phase is not Phase.PREFILLING:
                self.send(engine_id, ReleaseKV([prefilled.request_id]))  # nobody reads it any more
                continue
            source = self.prefill[engine_id].kv_source
            assert source is not None
            route.phase = Phase.LOADING
            route.load_sent_at = time.monotonic()
            self.send(route.decode, LoadKV(prefilled.request_id, source, prefilled.block_ids))
        for outcome in outputs.kv_loaded:
            route = self.routes.get(outcome.request_id)
            if route is None or route.decode != engine_id:
                continue
            if route.phase is Phase.LOADING:
                layout = self.decode[engine_id].kv_layout
                moved = max(0, outcome.num_tokens_loaded - (outcome.num_tokens_wanted - route.num_tokens_to_prefill))
                self.stats.observe_load(
                    time.monotonic() - route.load_sent_at,
                    outcome.complete,
                    moved * (layout.bytes_per_token if layout is not None else 0),
                )
            if route.prefill is not None and route.prefill in self.prefill:
                # Read, or the decode engine stopped waiting (its deadline) before the
                # prompt was even computed: either way the prefill side's work is over.
                done = ReleaseKV([outcome.request_id]) if route.phase is Phase.LOADING else None
                self.send(route.prefill, done or AbortRequests([outcome.request_id]))
            route.phase = Phase.DECODING
        for request_id, reason in outputs.rejected.items():
            route = self.routes.get(request_id)
            if route is None:
                continue
            if route.decode == engine_id:
                self._drop(route)  # the client hears the refusal from the decode engine's outputs
            elif route.prefill == engine_id and route.phase is Phase.PREFILLING:
                self._compute_on_decode(route, f"prefill engine {engine_id} refused it: {reason}")

    # ----- internals ----------------------------------------------------------------
    @staticmethod
    def _check_deadlines(engine_id: str, ready: EngineReady, others: Iterable[EngineReady]) -> None:
        """A prefill engine must hold KV longer than any decode engine waits for it: a
        decode engine that gives up cancels its read before the blocks can be reused."""
        for other in others:
            prefill, decode = (ready, other) if ready.kv_role == "prefill" else (other, ready)
            if prefill.kv_hold_timeout <= decode.kv_wait_timeout:
                raise ValueError(
                    f"engine {engine_id}: a prefill engine's kv_hold_timeout ({prefill.kv_hold_timeout:g} s) must "
                    f"exceed every decode engine's kv_wait_timeout ({decode.kv_wait_timeout:g} s)"
                )

    def _prefill_elsewhere(self, route: Route, reason: str | None) -> None:
        """Send the prompt to the least loaded live prefill engine, or compute it on the
        decode engine when there is none."""
        candidates = [e for e in self.prefill if e != route.prefill and e not in self.draining]
        if not candidates:
            self._compute_on_decode(route, reason or "no prefill engine is available")
            return
        if route.prefill is not None:
            self.stats.num_rerouted += 1
        engine = min(candidates, key=lambda e: (self._queued_prefill_tokens(e), e))
        route.prefill, route.phase = engine, Phase.PREFILLING
        route.wait_extended_at = time.monotonic()
        request = route.request
        self.stats.num_remote_prefills += 1
        self.stats.remote_prompt_tokens += route.num_tokens_to_prefill
        self.send(
            engine,
            EngineCoreRequest(
                request.request_id, request.prompt_token_ids, SamplingParams(max_tokens=1), request.priority, "send"
            ),
        )

    def _compute_on_decode(self, route: Route, reason: str, chunk_tokens: int | None = None) -> None:
        """Have the decode engine compute the prompt: in the placement's chunks, or for a
        fallback (no prefill engine, a refusal) in chunks by the same rule once a rate is
        measured, so that its streams keep flowing."""
        if chunk_tokens is None:
            measured = [self.engine_stats[engine] for engine in self.prefill if engine in self.engine_stats]
            prefill_rate = engine_rate(measured, "num_computed_tokens")
            decode_stats = self.engine_stats.get(route.decode, EngineStats())
            rate = local_prompt_rate(decode_stats, prefill_rate)
            chunk = max(local_chunk(self.placement, rate, self._step_limit(route)), MIN_LOCAL_CHUNK) if rate else 0
            chunk_tokens = chunk if chunk < route.num_tokens_to_prefill else 0
        if route.prefill is not None and route.prefill in self.prefill:
            self.send(route.prefill, AbortRequests([route.request.request_id]))
        route.prefill, route.phase = None, Phase.DECODING
        route.local_tokens_pending = route.num_tokens_to_prefill
        self.stats.num_local_prefills += 1
        self.send(route.decode, CancelKVWait([route.request.request_id], reason, chunk_tokens))

    def _drop(self, route: Route) -> None:
        """Free whatever a prefill engine holds or computes for the route."""
        self.routes.pop(route.request.request_id, None)
        busy = route.phase in (Phase.PREFILLING, Phase.LOADING)
        if busy and route.prefill is not None and route.prefill in self.prefill:
            self.send(route.prefill, AbortRequests([route.request.request_id]))

    def _extend_waits(self, prefill_engine: str) -> None:
        """A prefill engine that reports a step lives: its queued prompts' decode engines
        wait on. Their deadlines are for lost messages and hung engines, not for queues;
        without this an overloaded prefill pool would have its prompts computed on the
        decode engines, stalling their streams. Only while prefilling: from LOADING on the
        wait must stay shorter than the prefill engine's hold."""
        now = time.monotonic()
        due: dict[str, list[str]] = {}
        for request_id, route in self.routes.items():
            if route.prefill != prefill_engine or route.phase is not Phase.PREFILLING:
                continue
            decode = self.decode.get(route.decode)
            if decode is not None and now - route.wait_extended_at >= decode.kv_wait_timeout / 3:
                route.wait_extended_at = now
                due.setdefault(route.decode, []).append(request_id)
        for decode_engine, request_ids in due.items():
            self.send(decode_engine, ExtendKVWait(request_ids))

    def _step_limit(self, route: Route) -> int:
        """The most of one prompt a step of the route's decode engine computes."""
        ready = self.decode[route.decode]
        limits = [limit for limit in (ready.long_prefill_token_threshold, ready.max_num_batched_tokens) if limit > 0]
        return min(limits, default=route.num_tokens_to_prefill)

    def _place(self, route: Route) -> Placement:
        ready = self.decode[route.decode]
        load = DecodeLoad(
            self.engine_stats.get(route.decode, EngineStats()),
            sum(r.local_tokens_pending for r in self.routes.values() if r.decode == route.decode),
            self._step_limit(route),
        )
        return place_prompt(
            self.placement,
            route.num_tokens_to_prefill,
            load,
            [self._queued_prefill_tokens(engine) for engine in self.prefill if engine not in self.draining],
            [self.engine_stats[engine] for engine in self.prefill if engine in self.engine_stats],
            self.stats,
            ready.kv_layout.bytes_per_token if ready.kv_layout is not None else 0,
        )

    def _num_routes(self, engine_id: str) -> int:
        return sum(1 for route in self.routes.values() if route.decode == engine_id)

    def _queued_prefill_tokens(self, engine_id: str) -> int:
        return sum(
            route.num_tokens_to_prefill
            for route in self.routes.values()
            if route.prefill == engine_id and route.phase is Phase.PREFILLING
        )
