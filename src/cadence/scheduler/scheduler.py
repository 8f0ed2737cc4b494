"""The token-budget scheduler: one rule for continuous batching, chunked prefill and reuse.

Each step, running requests are served first (oldest and most important first), then
waiting requests are admitted in (priority, arrival) order while the token budget, the
sequence limit and free KV blocks allow. A request that does not fit in the remaining
budget is chunked. When blocks run out, the newest lowest-priority running request is
preempted: its blocks are freed and it is recomputed later. Seats and budget are shared
between client requests, not sequences (scheduler/fair_share.py), so that one request's
n sequences or long prompt cannot crowd out the others.

Each step's `SchedulerOutput` (scheduler/output.py) tells the model runner only what
changed; the scheduler keeps the step's `Request` objects to itself for `update`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from cadence.scheduler.fair_share import FairShare
from cadence.scheduler.kv_cache_manager import BlockCopy, CacheConfig, KVCacheManager, cdiv
from cadence.scheduler.output import NewRequestData, SchedulerOutput, describe
from cadence.scheduler.remote_kv import (
    KVLoad,
    KVLoadOutcome,
    KVLoadResult,
    KVPrefilled,
    KVReservation,
    RemoteKV,
)
from cadence.scheduler.request import Request, RequestStatus
from cadence.scheduler.step_chunks import ScheduledRequest, StepChunks


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits on one step's batch and on a sequence's length."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    # At most this many of one prompt's tokens per step (0: as many as the budget holds),
    # so a long prompt shares each step with the others' tokens instead of filling it.
    long_prefill_token_threshold: int = 0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(f"invalid scheduler limits: {self}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError(f"long_prefill_token_threshold must not be negative: {self}")


@dataclass
class KVEvents:
    """What happened to cross-engine prompt KV since they were last taken."""

    reserved: list[KVReservation]
    prefilled: list[KVPrefilled]
    loaded: list[KVLoadOutcome]


@dataclass
class FinishedRequest:
    """A request that ended during `update`, with the reason."""

    request: Request
    status: RequestStatus


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.kv_cache = KVCacheManager(cache_config)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # kept sorted by Request.sort_key
        self.running: list[Request] = []
        # Children of an n>1 request, waiting for their parent's prompt KV.
        self.pending_forks: dict[str, list[Request]] = {}
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        # The latest step's work, which `update` advances; the runner never sees it.
        self._last_output: SchedulerOutput | None = None
        self._scheduled: list[ScheduledRequest] = []
        # Cross-engine prompt KV (scheduler/remote_kv.py). Decode side: requests parked on
        # reserved blocks, those whose load the runner has, and blocks of requests that
        # ended mid-load, freed once the runner reports the load over. Prefill side:
        # requests computed for a reader, holding their blocks.
        self.awaiting_kv: dict[str, Request] = {}
        self.held_kv: dict[str, Request] = {}
        self._loading: set[str] = set()
        self._cancelled_loads: set[str] = set()
        self._orphaned_loads: dict[str, list[int]] = {}
        self._kv_loads: list[KVLoad] = []
        self._kv_cancels: list[str] = []
        self._kv_events = KVEvents([], [], [])

    # ----- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self._orphaned_loads:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        parent_id = request.fork_parent_id
        if parent_id is not None and parent_id in self.requests and not self._prompt_done(parent_id):
            self.pending_forks.setdefault(parent_id, []).append(request)
        else:
            request.fork_parent_id = None
            self._enqueue(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort and free the named requests; unknown or finished ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    # ----- prompt KV from and for other engines (scheduler/remote_kv.py) ---------------
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

    def release_sent_kv(self, request_ids: Iterable[str]) -> list[Request]:
        """Free the blocks held for readers that are done with them; unknown ids are ignored."""
        released = []
        for request_id in request_ids:
            request = self.held_kv.get(request_id)
            if request is not None:
                self._finish(request, RequestStatus.FINISHED_SENT)
                released.append(request)
        return released

    def take_kv_events(self) -> KVEvents:
        events, self._kv_events = self._kv_events, KVEvents([], [], [])
        return events

    def _reserve_for_remote_kv(self, request: Request) -> bool | None:
        """Reserve blocks for a LOAD request's prompt and park it: True if parked, False
        if the prefix cache already holds all it would load, None if blocks are short."""
        cached_prefix = self.kv_cache.find_cached_prefix(request)
        num_cached = len(cached_prefix) * self.kv_cache.block_size
        wanted = request.num_prompt_tokens - 1
        if num_cached >= wanted:
            request.remote_kv = None
            self._kv_events.reserved.append(KVReservation(request.request_id, num_cached, wanted))
            return False
        if self.kv_cache.allocate_slots(request, request.num_tokens - num_cached, cached_prefix) is None:
            return None
        self.waiting.remove(request)
        self.kv_cache.count_lookup(request, num_cached)
        request.num_cached_tokens = num_cached
        request.status = RequestStatus.WAITING_FOR_KV
        self.awaiting_kv[request.request_id] = request
        self._kv_events.reserved.append(KVReservation(request.request_id, num_cached, wanted))
        return True

    def _end_kv_wait(self, request: Request, num_tokens_loaded: int, error: str | None) -> None:
        """Unpark a request with its first `num_tokens_loaded` tokens' KV in place; it
        keeps its blocks and computes the rest here like any waiting request."""
        del self.awaiting_kv[request.request_id]
        wanted = request.num_prompt_tokens - 1
        request.remote_kv = None
        request.num_computed_tokens = max(request.num_computed_tokens, num_tokens_loaded)
        self.kv_cache.cache_computed_blocks(request)
        self._enqueue(request)
        self._kv_events.loaded.append(KVLoadOutcome(request.request_id, num_tokens_loaded, wanted, error))

    def _drop_unsent_load(self, request_id: str) -> None:
        """A load the runner has not been given yet is simply never given."""
        if any(load.request_id == request_id for load in self._kv_loads):
            self._kv_loads = [load for load in self._kv_loads if load.request_id != request_id]
            self._loading.discard(request_id)

    def _hold_for_reader(self, request: Request) -> None:
        """A SEND request's prompt KV is complete: keep its blocks for the reader; the
        runner forgets it."""
        if request in self.running:
            self.running.remove(request)
        request.status = RequestStatus.HOLDING_KV
        request.runner_view = None
        self.held_kv[request.request_id] = request
        self._finished_ids.append(request.request_id)
        num_blocks = cdiv(request.num_tokens_to_compute, self.kv_cache.block_size)
        self._kv_events.prefilled.append(
            KVPrefilled(request.request_id, request.block_ids[:num_blocks], request.num_tokens_to_compute)
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step would do anything: compute, or start, stop or wait on a load.
        Requests parked for KV that nobody sent yet, and KV held for a reader, are not work."""
        return bool(
            self.running or self.waiting or self._kv_loads or self._kv_cancels or self._loading or self._orphaned_loads
        )

    # ----- one step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        copies: list[BlockCopy] = []
        preempted_now = False

        chunks = StepChunks(self.config.long_prefill_token_threshold)
        fair = FairShare(self.running, self.waiting, self.config.max_num_seqs)
        for victim in fair.seats_to_free(self.running):
            self._preempt(victim, scheduled)
        self.running.sort(key=fair.turn_key)
        fair.share_tokens(self.running, chunks, budget, self.config.max_num_seqs - len(self.running))
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            remaining = request.num_tokens_left
            num_new = min(chunks.size(request, remaining, budget), fair.grant(request))
            # Its share went to an earlier capped prompt, or to the other requests.
            if chunks.used_up(request, remaining) or num_new == 0:
                index += 1
                continue
            while True:
                new_copies = self.kv_cache.allocate_slots(request, num_new)
                if new_copies is not None:
                    break
                if self._reclaim_waiting_blocks():
                    continue
                victim = fair.victim(self.running[index:])  # never one that has its tokens already
                budget += self._preempt(victim, scheduled)
                preempted_now = True
                if victim is request:
                    break
            if new_copies is None:
                continue  # the request itself was preempted; the next one now stands at `index`
            copies.extend(new_copies)
            scheduled[request.request_id] = ScheduledRequest(request, num_new)
            chunks.took(request, remaining, num_new)
            fair.took(request, num_new)
            budget -= num_new
            index += 1

        # Admitting new work while preempting would only thrash the cache. Capped prompts
        # with no share left wait a step, without holding up those behind them.
        passed_over: list[Request] = []
        while self.waiting and budget > 0 and not preempted_now and len(self.running) < self.config.max_num_seqs:
            position = fair.next_waiting(self.waiting)
            request = self.waiting[position]
            if chunks.used_up(request, request.num_tokens_left):
                passed_over.append(self.waiting.pop(position))
                continue
            if request.remote_kv is RemoteKV.LOAD:
                parked = self._reserve_for_remote_kv(request)
                if parked is None and self._reclaim_waiting_blocks():
                    continue
                if parked is None:
                    break
                if parked:
                    continue
                # The prefix cache had the whole prompt: it runs here like any other.
            cached_prefix = [] if request.block_ids else self.kv_cache.find_cached_prefix(request)
            num_computed = request.num_computed_tokens + len(cached_prefix) * self.kv_cache.block_size
            remaining = request.num_tokens_to_compute - num_computed
            num_new = chunks.size(request, remaining, budget)
            new_copies = self.kv_cache.allocate_slots(request, num_new, cached_prefix)
            if new_copies is None:
                # Children further back may pin the blocks this one needs; with nothing
                # running, nobody else would ever free them.
                if self._reclaim_waiting_blocks():
                    continue
                break
            self.waiting.pop(position)
            self.kv_cache.count_lookup(request, len(cached_prefix) * self.kv_cache.block_size)
            if request.num_preemptions == 0 and cached_prefix:
                request.num_cached_tokens = len(cached_prefix) * self.kv_cache.block_size
            if num_new == 0:  # a prompt to send that the prefix cache holds whole
                self._hold_for_reader(request)
                continue
            copies.extend(new_copies)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            fair.admitted(request)
            scheduled[request.request_id] = ScheduledRequest(request, num_new)
            chunks.took(request, remaining, num_new)
            budget -= num_new
        for request in passed_over:
            bisect.insort(self.waiting, request, key=lambda r: r.sort_key)
        copies.extend(fair.pass_on(self.running, scheduled, budget, self.kv_cache))

        output = SchedulerOutput(
            num_scheduled_tokens={request_id: item.num_new_tokens for request_id, item in scheduled.items()},
            block_copies=copies,
            finished_request_ids=self._finished_ids,
            preempted_request_ids=self._preempted_ids,
            kv_loads=self._kv_loads,
            kv_cancels=self._kv_cancels,
        )
        for item in scheduled.values():
            data = describe(item.request)
            if isinstance(data, NewRequestData):
                output.new_requests.append(data)
            else:
                output.cached_requests.append(data)
        self._finished_ids, self._preempted_ids = [], []
        self._kv_loads, self._kv_cancels = [], []
        self._last_output, self._scheduled = output, list(scheduled.values())
        return output

    def update(self, output: SchedulerOutput, sampled_token_ids: dict[str, int]) -> list[FinishedRequest]:
        """Advance the requests of `output`, the latest step, by what the model computed
        and sampled."""
        if output is not self._last_output:
            raise ValueError("update() takes the output of the latest schedule()")
        scheduled, self._last_output, self._scheduled = self._scheduled, None, []
        finished: list[FinishedRequest] = []
        for item in scheduled:
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_computed_blocks(request)
            if request.remote_kv is RemoteKV.SEND and request.num_computed_tokens >= request.num_tokens_to_compute:
                self._hold_for_reader(request)
                continue
            if request.num_computed_tokens >= request.num_prompt_tokens:
                self._release_forks(request)
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            status = request.check_stop(self.config.max_model_len)
            if status is not None:
                self._finish(request, status)
                finished.append(FinishedRequest(request, status))
        return finished

    # ----- internals -----------------------------------------------------------------
    def _enqueue(self, request: Request) -> None:
        request.status = RequestStatus.WAITING if request.num_preemptions == 0 else RequestStatus.PREEMPTED
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def _preempt(self, victim: Request, scheduled: dict[str, ScheduledRequest]) -> int:
        """Free the victim and requeue it; returns the budget it had been given this step."""
        self.running.remove(victim)
        self.kv_cache.free(victim)
        victim.runner_view = None
        victim.num_preemptions += 1
        self._enqueue(victim)
        self._preempted_ids.append(victim.request_id)
        item = scheduled.pop(victim.request_id, None)
        return item.num_new_tokens if item is not None else 0

    def _reclaim_waiting_blocks(self) -> bool:
        """Free the blocks of the last waiting request that holds any (a forked child).

        Such a child would otherwise pin shared prompt blocks while the running requests
        starve; it recomputes its prompt when admitted.
        """
        for request in reversed(self.waiting):
            if request.block_ids:
                self.kv_cache.free(request)
                return True
        return False

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self.requests.pop(request.request_id, None)
        self.held_kv.pop(request.request_id, None)
        self._drop_unsent_load(request.request_id)
        if self.awaiting_kv.pop(request.request_id, None) is not None and request.request_id in self._loading:
            # A transfer may still write into its blocks: they wait for the runner's word.
            self._loading.discard(request.request_id)
            self._cancelled_loads.discard(request.request_id)
            self._kv_cancels.append(request.request_id)
            self._orphaned_loads[request.request_id] = request.block_ids
            request.block_ids = []
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        for siblings in self.pending_forks.values():
            if request in siblings:
                siblings.remove(request)
        self.kv_cache.free(request)
        request.runner_view = None
        self._finished_ids.append(request.request_id)
        # Children still waiting for this prompt must compute it themselves.
        for child in self.pending_forks.pop(request.request_id, []):
            child.fork_parent_id = None
            self._enqueue(child)

    def _prompt_done(self, request_id: str) -> bool:
        request = self.requests[request_id]
        return request.num_computed_tokens >= request.num_prompt_tokens

    def _release_forks(self, parent: Request) -> None:
        for child in self.pending_forks.pop(parent.request_id, []):
            self.kv_cache.fork(parent, child)
            child.fork_parent_id = None
            self._enqueue(child)

    def check_integrity(self) -> None:
        """Assert the queues, statuses and the KV cache agree (tests call it every step)."""
        pending = [r for children in self.pending_forks.values() for r in children]
        parked = list(self.awaiting_kv.values()) + list(self.held_kv.values())
        tracked = self.running + self.waiting + pending + parked
        assert len({r.request_id for r in tracked}) == len(tracked), "a request is queued twice"
        assert {r.request_id for r in tracked} == set(self.requests), "queues and request map differ"
        assert len(self.running) <= self.config.max_num_seqs
        for request in self.running:
            assert request.status == RequestStatus.RUNNING, f"{request.request_id} running as {request.status}"
            assert request.runner_view is not None, f"running {request.request_id} was never sent to the runner"
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        for request in pending:
            assert not request.block_ids, f"unforked {request.request_id} holds blocks"
        for request in self.waiting + pending + parked:
            assert request.runner_view is None, f"the runner still holds waiting {request.request_id}"
        for request in self.awaiting_kv.values():
            assert request.status == RequestStatus.WAITING_FOR_KV and request.remote_kv is RemoteKV.LOAD
        for request in self.held_kv.values():
            assert request.status == RequestStatus.HOLDING_KV and request.remote_kv is RemoteKV.SEND
        assert self._loading <= set(self.awaiting_kv), "a load runs for a request that is not parked"
        assert self._cancelled_loads <= self._loading, "a cancelled load is not running"
        assert {load.request_id for load in self._kv_loads} <= self._loading, "a load to start is not running"
        assert not set(self._orphaned_loads) & set(self.requests), "a live request owns an orphaned load"
        for request in self.held_kv.values():
            assert request.num_computed_tokens == request.num_tokens_to_compute, f"{request.request_id} held early"
        for request in self.running + self.waiting:
            assert request.remote_kv is not RemoteKV.LOAD or not request.block_ids, f"{request.request_id} loads"
        assert self.waiting == sorted(self.waiting, key=lambda r: r.sort_key), "waiting out of order"
        self.kv_cache.check_integrity(tracked, self._orphaned_loads.values())
