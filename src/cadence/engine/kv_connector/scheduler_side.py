"""The scheduler half of the KV connector: requests waiting for prompt KV from another
engine, and requests holding theirs for a reader, with their deadlines.

Pure Python and block ids (scheduler/remote_kv.py has the data); the engine core calls
it with the router's messages, the scheduler through its hooks (scheduler/connector.py).
Blocks that a transfer may still be writing are never freed: a load the runner started
is cancelled first, and its blocks wait for the runner's result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

from cadence.engine.kv_connector.deadlines import KVDeadlines
from cadence.scheduler.connector import Admission, SchedulerConnector
from cadence.scheduler.kv_cache_manager import KVCacheManager, cdiv
from cadence.scheduler.remote_kv import (
    KVLoad,
    KVLoadOutcome,
    KVLoadResult,
    KVPrefilled,
    KVReservation,
    RemoteKV,
)
from cadence.scheduler.request import Request, RequestStatus
from cadence.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


@dataclass
class KVEvents:
    """What happened to cross-engine prompt KV since they were last taken."""

    reserved: list[KVReservation]
    prefilled: list[KVPrefilled]
    loaded: list[KVLoadOutcome]


class SchedulerSideConnector(SchedulerConnector):
    """Parks LOAD requests on reserved blocks until their KV is loaded, and holds SEND
    requests' blocks until their reader is done, each wait bounded by a deadline."""

    def __init__(self, wait_timeout: float, hold_timeout: float) -> None:
        # Decode side: requests parked on reserved blocks, those whose load the runner
        # has, and blocks of requests that ended mid-load, freed once the runner reports
        # the load over. Prefill side: requests computed for a reader, holding their blocks.
        self.awaiting_kv: dict[str, Request] = {}
        self.held_kv: dict[str, Request] = {}
        self._loading: set[str] = set()
        self._cancelled_loads: set[str] = set()
        self._orphaned_loads: dict[str, list[int]] = {}
        self._kv_loads: list[KVLoad] = []
        self._kv_cancels: list[str] = []
        self._kv_events = KVEvents([], [], [])
        self.deadlines = KVDeadlines(wait_timeout, hold_timeout)
        self.num_expired_kv = 0
        self._scheduler: Scheduler | None = None

    def attach(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler

    @property
    def scheduler(self) -> Scheduler:
        assert self._scheduler is not None, "a connector works for the scheduler it is attached to"
        return self._scheduler

    @property
    def kv_cache(self) -> KVCacheManager:
        return self.scheduler.kv_cache

    # ----- the router's messages, through the engine core -----------------------------
    def start_kv_load(self, request_id: str, source: object, remote_block_ids: list[int]) -> str | None:
        """Load a parked request's missing prompt KV from `source`, whose block i holds
        tokens [i * block_size, (i + 1) * block_size). Returns why not, or None.

        A source too short for the prompt ends the wait at once: the request computes
        what it lacks here."""
        request = self.awaiting_kv.get(request_id)
        if request is None:
            return f"request {request_id!r} is not waiting for KV"
        if request_id in self._loading:
            return f"request {request_id!r} is already loading KV"
        first = request.num_computed_tokens // self.kv_cache.block_size
        last = cdiv(request.num_prompt_tokens - 1, self.kv_cache.block_size)
        if len(remote_block_ids) < last:
            error = f"the source holds {len(remote_block_ids)} blocks of the prompt's {last}"
            self._end_kv_wait(request, request.num_computed_tokens, error)
            return error
        self._loading.add(request_id)
        self._kv_loads.append(
            KVLoad(request_id, source, list(remote_block_ids[first:last]), request.block_ids[first:last])
        )
        return None

    def cancel_kv_wait(self, request_id: str, reason: str, chunk_tokens: int = 0) -> bool:
        """Stop waiting for a parked request's KV (its source died, or its deadline
        passed): it computes what did not arrive here, at most `chunk_tokens` a step when
        that is set. False if it was not parked."""
        request = self.awaiting_kv.get(request_id)
        if request is None:
            return False
        request.max_chunk_tokens = chunk_tokens
        self._drop_unsent_load(request_id)
        if request_id in self._loading:
            self._kv_cancels.append(request_id)  # the runner's result ends the wait
            self._cancelled_loads.add(request_id)
        else:
            self._end_kv_wait(request, request.num_computed_tokens, reason)
        return True

    def extend_kv_wait(self, request_ids: Iterable[str]) -> None:
        """Wait `wait_timeout` more from now for these parked requests' KV."""
        now = time.monotonic()
        for request_id in request_ids:
            if request_id in self.awaiting_kv:
                self.deadlines.extend_wait(request_id, now)

    def release_sent_kv(self, request_ids: Iterable[str]) -> list[Request]:
        """Free the blocks held for readers that are done with them; unknown ids are ignored."""
        released = []
        for request_id in request_ids:
            request = self.held_kv.get(request_id)
            if request is not None:
                self.scheduler.end_request(request, RequestStatus.FINISHED_SENT)
                released.append(request)
        return released

    def take_kv_events(self) -> KVEvents:
        """What happened since the last call, by scheduler request id; waits and holds
        still going from these events get their deadlines now."""
        events, self._kv_events = self._kv_events, KVEvents([], [], [])
        now = time.monotonic()
        # A request may have moved on, or ended, since its event: only live waits get deadlines.
        for reservation in events.reserved:
            if reservation.request_id in self.awaiting_kv:
                self.deadlines.start_wait(reservation.request_id, now)
        for prefilled in events.prefilled:
            if prefilled.request_id in self.held_kv:
                self.deadlines.start_hold(prefilled.request_id, now)
        for outcome in events.loaded:
            self.deadlines.drop(outcome.request_id)
        return events

    def expire_kv_deadlines(self) -> list[Request]:
        """End waits for KV that never came, and release KV no reader said it was done
        with; returns the requests released (they are finished)."""
        released: list[Request] = []
        for request_id in self.deadlines.take_due(time.monotonic()):
            if request_id in self.awaiting_kv:
                self.cancel_kv_wait(request_id, f"no KV arrived within {self.deadlines.wait_timeout:g} s")
                self.num_expired_kv += 1
                logger.warning("%s: no prompt KV arrived in time; computing the prompt here", request_id)
            elif request_id in self.held_kv:
                released.extend(self.release_sent_kv([request_id]))
                self.num_expired_kv += 1
                logger.warning("%s: no reader acknowledged its prompt KV in time; freed", request_id)
        return released

    def next_kv_deadline(self) -> float | None:
        """When the earliest wait for, or hold of, prompt KV ends (time.monotonic)."""
        return self.deadlines.earliest()

    # ----- the runner's reports -------------------------------------------------------
    def finish_kv_loads(self, results: list[KVLoadResult]) -> None:
        """Apply the runner's reports on the loads it was given."""
        block_size = self.kv_cache.block_size
        for result in results:
            orphaned = self._orphaned_loads.pop(result.request_id, None)
            if orphaned is not None:
                self.kv_cache.pool.free(reversed(orphaned))
                continue
            if result.request_id not in self._loading:
                continue
            self._loading.discard(result.request_id)
            request = self.awaiting_kv[result.request_id]
            if result.request_id in self._cancelled_loads:
                # Cancelled because its time ran out: the source may have freed its blocks
                # since, so nothing that arrived is trusted.
                self._cancelled_loads.discard(result.request_id)
                result = KVLoadResult(result.request_id, 0, result.error or "cancelled")
            loaded = request.num_computed_tokens + result.num_blocks_loaded * block_size
            self._end_kv_wait(request, min(loaded, request.num_prompt_tokens - 1), result.error)

    # ----- the scheduler's hooks ------------------------------------------------------
    def uses_request_id(self, request_id: str) -> bool:
        return request_id in self._orphaned_loads

    def admit(self, request: Request) -> Admission:
        """Reserve blocks for a LOAD request's prompt and park it, unless the prefix cache
        already holds all it would load."""
        if request.remote_kv is not RemoteKV.LOAD:
            return Admission.SCHEDULE
        cached_prefix = self.kv_cache.find_cached_prefix(request)
        num_cached = len(cached_prefix) * self.kv_cache.block_size
        wanted = request.num_prompt_tokens - 1
        if num_cached >= wanted:
            request.remote_kv = None
            self._kv_events.reserved.append(KVReservation(request.request_id, num_cached, wanted))
            return Admission.SCHEDULE
        if self.kv_cache.allocate_slots(request, request.num_tokens - num_cached, cached_prefix) is None:
            return Admission.NO_BLOCKS
        self.kv_cache.count_lookup(request, num_cached)
        request.num_cached_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_KV
        self.awaiting_kv[request.request_id] = request
        self._kv_events.reserved.append(KVReservation(request.request_id, num_cached, wanted))
        return Admission.PARKED

    def update(self, request: Request) -> bool:
        """A SEND request's prompt KV is complete: keep its blocks for the reader."""
        if request.remote_kv is not RemoteKV.SEND or request.num_computed_tokens < request.num_tokens_to_compute:
            return False
        request.status = RequestStatus.HOLDING_KV
        self.held_kv[request.request_id] = request
        num_blocks = cdiv(request.num_tokens_to_compute, self.kv_cache.block_size)
        self._kv_events.prefilled.append(
            KVPrefilled(request.request_id, request.block_ids[:num_blocks], request.num_tokens_to_compute)
        )
        return True

    def finish(self, request: Request) -> None:
        self.deadlines.drop(request.request_id)
        self.held_kv.pop(request.request_id, None)
        self._drop_unsent_load(request.request_id)
        if self.awaiting_kv.pop(request.request_id, None) is not None and request.request_id in self._loading:
            # A transfer may still write into its blocks: they wait for the runner's word.
            self._loading.discard(request.request_id)
            self._cancelled_loads.discard(request.request_id)
            self._kv_cancels.append(request.request_id)
            self._orphaned_loads[request.request_id] = request.block_ids
            request.block_ids = []

    def has_work(self) -> bool:
        """Requests parked for KV that nobody sent yet, and KV held for a reader, are not work."""
        return bool(self._kv_loads or self._kv_cancels or self._loading or self._orphaned_loads)

    def take_step_work(self) -> tuple[list[KVLoad], list[str]]:
        loads, cancels = self._kv_loads, self._kv_cancels
        self._kv_loads, self._kv_cancels = [], []
        return loads, cancels

    def parked_requests(self) -> list[Request]:
        return list(self.awaiting_kv.values()) + list(self.held_kv.values())

    def blocks_without_request(self) -> Iterable[list[int]]:
        return self._orphaned_loads.values()

    def check_integrity(self) -> None:
        scheduler = self.scheduler
        for request in self.awaiting_kv.values():
            assert request.status == RequestStatus.WAITING_FOR_KV and request.remote_kv is RemoteKV.LOAD
        for request in self.held_kv.values():
            assert request.status == RequestStatus.HOLDING_KV and request.remote_kv is RemoteKV.SEND
        assert self._loading <= set(self.awaiting_kv), "a load runs for a request that is not parked"
        assert self._cancelled_loads <= self._loading, "a cancelled load is not running"
        assert {load.request_id for load in self._kv_loads} <= self._loading, "a load to start is not running"
        assert not set(self._orphaned_loads) & set(scheduler.requests), "a live request owns an orphaned load"
        for request in self.held_kv.values():
            assert request.num_computed_tokens == request.num_tokens_to_compute, f"{request.request_id} held early"
        for request in scheduler.running + scheduler.waiting:
            assert request.remote_kv is not RemoteKV.LOAD or not request.block_ids, f"{request.request_id} loads"

    # ----- internals ------------------------------------------------------------------
    def _end_kv_wait(self, request: Request, num_tokens_loaded: int, error: str | None) -> None:
        """Unpark a request with its first `num_tokens_loaded` tokens' KV in place; it
        keeps its blocks and computes the rest here like any waiting request."""
        del self.awaiting_kv[request.request_id]
        wanted = request.num_prompt_tokens - 1
        request.remote_kv = None
        request.num_computed_tokens = max(request.num_computed_tokens, num_tokens_loaded)
        self.kv_cache.cache_computed_blocks(request)
        self.scheduler.enqueue(request)
        self._kv_events.loaded.append(KVLoadOutcome(request.request_id, num_tokens_loaded, wanted, error))

    def _drop_unsent_load(self, request_id: str) -> None:
        """A load the runner has not been given yet is simply never given."""
        if any(load.request_id == request_id for load in self._kv_loads):
            self._kv_loads = [load for load in self._kv_loads if load.request_id != request_id]
            self._loading.discard(request_id)
