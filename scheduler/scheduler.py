"""The token-budget scheduler: one rule for continuous batching, chunked prefill and reuse.

Each step, running requests are served first (oldest and most important first), then
waiting requests are admitted in (priority, arrival) order while the token budget, the
sequence limit and free KV blocks allow. A request that does not fit in the remaining
budget is chunked. When blocks run out, the newest lowest-priority running request is
preempted: its blocks are freed and it is recomputed later.

Each step's `SchedulerOutput` (scheduler/output.py) tells the model runner only what
changed; the scheduler keeps the step's `Request` objects to itself for `update`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass

from cadence.scheduler.kv_cache_manager import BlockCopy, KVCacheManager
from cadence.scheduler.output import NewRequestData, SchedulerOutput, describe
from cadence.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits on one step's batch and on a sequence's length."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.max_model_len < 2:
            raise ValueError(f"invalid scheduler limits: {self}")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: how many blocks of how many tokens, and prefix reuse."""

    num_blocks: int
    block_size: int = 16
    enable_prefix_caching: bool = True


@dataclass
class ScheduledRequest:
    """`num_new_tokens` tokens of `request`, from position `request.num_computed_tokens`."""

    request: Request
    num_new_tokens: int


@dataclass
class FinishedRequest:
    """A request that ended during `update`, with the reason."""

    request: Request
    status: RequestStatus


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.kv_cache = KVCacheManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching
        )
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

    # ----- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
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

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ----- one step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        copies: list[BlockCopy] = []
        preempted_now = False

        self.running.sort(key=lambda r: r.sort_key)
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            while True:
                new_copies = self.kv_cache.allocate_slots(request, num_new)
                if new_copies is not None:
                    break
                if self._reclaim_waiting_blocks():
                    continue
                victim = self.running[-1]  # the newest of the lowest priority
                budget += self._preempt(victim, scheduled)
                preempted_now = True
                if victim is request:
                    break
            if new_copies is None:
                break  # the request itself was preempted; everything after it already was
            copies.extend(new_copies)
            scheduled[request.request_id] = ScheduledRequest(request, num_new)
            budget -= num_new
            index += 1

        # Admitting new work while preempting would only thrash the cache.
        while self.waiting and budget > 0 and not preempted_now and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            cached_prefix = [] if request.block_ids else self.kv_cache.find_cached_prefix(request)
            num_computed = request.num_computed_tokens + len(cached_prefix) * self.kv_cache.block_size
            num_new = min(request.num_tokens - num_computed, budget)
            new_copies = self.kv_cache.allocate_slots(request, num_new, cached_prefix)
            if new_copies is None:
                # Children further back may pin the blocks this one needs; with nothing
                # running, nobody else would ever free them.
                if self._reclaim_waiting_blocks():
                    continue
                break
            self.waiting.pop(0)
            if request.num_preemptions == 0 and cached_prefix:
                request.num_cached_tokens = len(cached_prefix) * self.kv_cache.block_size
            copies.extend(new_copies)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled[request.request_id] = ScheduledRequest(request, num_new)
            budget -= num_new

        output = SchedulerOutput(
            num_scheduled_tokens={request_id: item.num_new_tokens for request_id, item in scheduled.items()},
            block_copies=copies,
            finished_request_ids=self._finished_ids,
            preempted_request_ids=self._preempted_ids,
        )
        for item in scheduled.values():
            data = describe(item.request)
            if isinstance(data, NewRequestData):
                output.new_requests.append(data)
            else:
                output.cached_requests.append(data)
        self._finished_ids, self._preempted_ids = [], []
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
        tracked = self.running + self.waiting + pending
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
        for request in self.waiting + pending:
            assert request.runner_view is None, f"the runner still holds waiting {request.request_id}"
        assert self.waiting == sorted(self.waiting, key=lambda r: r.sort_key), "waiting out of order"
        self.kv_cache.check_integrity(tracked)
