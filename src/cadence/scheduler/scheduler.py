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
Prompt KV that crosses engines is a connector's business (scheduler/connector.py): the
scheduler only calls its hooks, and a colocated engine has none.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from cadence.scheduler.connector import Admission, SchedulerConnector
from cadence.scheduler.fair_share import FairShare
from cadence.scheduler.kv_cache_manager import BlockCopy, CacheConfig, KVCacheManager
from cadence.scheduler.output import NewRequestData, SchedulerOutput, describe
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
class FinishedRequest:
    """A request that ended during `update`, with the reason."""

    request: Request
    status: RequestStatus


@dataclass
class _Step:
    """What one `schedule` call has decided so far, handed from phase to phase."""

    budget: int
    chunks: StepChunks
    fair: FairShare
    scheduled: dict[str, ScheduledRequest] = field(default_factory=dict)
    copies: list[BlockCopy] = field(default_factory=list)
    # Set once this step preempts for blocks; it then admits nothing new.
    preempted: bool = False


class Scheduler:
    """Decides, each step, which tokens of which requests the model computes."""

    def __init__(
        self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, connector: SchedulerConnector | None = None
    ) -> None:
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
        # Prompt KV that crosses engines (scheduler/connector.py); None when it never does.
        self.connector = connector
        if connector is not None:
            connector.attach(self)

    # ----- requests in and out -------------------------------------------------------
    def add_request(self, request: Request) -> None:
        connector = self.connector
        if request.request_id in self.requests or (
            connector is not None and connector.uses_request_id(request.request_id)
        ):
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        parent_id = request.fork_parent_id
        if parent_id is not None and parent_id in self.requests and not self._prompt_done(parent_id):
            self.pending_forks.setdefault(parent_id, []).append(request)
        else:
            request.fork_parent_id = None
            self.enqueue(request)

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Abort and free the named requests; unknown or finished ids are ignored."""
        aborted = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self.end_request(request, RequestStatus.FINISHED_ABORTED)
            aborted.append(request)
        return aborted

    def enqueue(self, request: Request) -> None:
        """Queue a request for admission (again, when a connector lets it go)."""
        request.status = RequestStatus.WAITING if request.num_preemptions == 0 else RequestStatus.PREEMPTED
        bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def end_request(self, request: Request, status: RequestStatus) -> None:
        """Finish a request and free what it holds (a connector may keep blocks a transfer still writes)."""
        request.status = status
        self.requests.pop(request.request_id, None)
        if self.connector is not None:
            self.connector.finish(request)
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
            self.enqueue(child)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Whether a step would do anything: compute, or start, stop or wait on a load."""
        return bool(self.running or self.waiting) or (self.connector is not None and self.connector.has_work())

    # ----- one step ----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        step = _Step(
            budget=self.config.max_num_batched_tokens,
            chunks=StepChunks(self.config.long_prefill_token_threshold),
            fair=FairShare(self.running, self.waiting, self.config.max_num_seqs),
        )
        self._free_fair_seats(step)
        self._schedule_running(step)
        self._admit_waiting(step)
        step.copies.extend(step.fair.pass_on(self.running, step.scheduled, step.budget, self.kv_cache))
        return self._build_output(step)

    def _free_fair_seats(self, step: _Step) -> None:
        """Preempt for the requests owed a seat, then share this step's tokens between
        the running requests in turn order."""
        fair = step.fair
        for victim in fair.seats_to_free(self.running):
            self._preempt(victim, step.scheduled)
        self.running.sort(key=fair.turn_key)
        fair.share_tokens(self.running, step.chunks, step.budget, self.config.max_num_seqs - len(self.running))

    def _schedule_running(self, step: _Step) -> None:
        chunks, fair = step.chunks, step.fair
        index = 0
        while index < len(self.running) and step.budget > 0:
            request = self.running[index]
            remaining = request.num_tokens_left
            num_new = min(chunks.size(request, remaining, step.budget), fair.grant(request))
            # Its share went to an earlier capped prompt, or to the other requests.
            if chunks.used_up(request, remaining) or num_new == 0:
                index += 1
                continue
            new_copies = self._allocate_or_preempt(step, request, num_new, index)
            if new_copies is None:
                continue  # the request itself was preempted; the next one now stands at `index`
            step.copies.extend(new_copies)
            step.scheduled[request.request_id] = ScheduledRequest(request, num_new)
            chunks.took(request, remaining, num_new)
            fair.took(request, num_new)
            step.budget -= num_new
            index += 1

    def _allocate_or_preempt(self, step: _Step, request: Request, num_new: int, index: int) -> list[BlockCopy] | None:
        """Allocate a running request's slots, preempting from `index` on until they fit;
        None when the request itself was preempted."""
        while True:
            new_copies = self.kv_cache.allocate_slots(request, num_new)
            if new_copies is not None:
                return new_copies
            if self._reclaim_waiting_blocks():
                continue
            victim = step.fair.victim(self.running[index:])  # never one that has its tokens already
            step.budget += self._preempt(victim, step.scheduled)
            step.preempted = True
            if victim is request:
                return None

    def _admit_waiting(self, step: _Step) -> None:
        """Admit waiting requests while budget, seats and blocks allow.

        Admitting new work while preempting would only thrash the cache. Capped prompts
        with no share left wait a step, without holding up those behind them.
        """
        chunks, fair, connector = step.chunks, step.fair, self.connector
        passed_over: list[Request] = []
        while self.waiting and step.budget > 0 and not step.preempted and len(self.running) < self.config.max_num_seqs:
            position = fair.next_waiting(self.waiting)
            request = self.waiting[position]
            if chunks.used_up(request, request.num_tokens_left):
                passed_over.append(self.waiting.pop(position))
                continue
            if connector is not None and request.remote_kv is not None:
                admission = connector.admit(request)
                if admission is Admission.NO_BLOCKS and self._reclaim_waiting_blocks():
                    continue
                if admission is Admission.NO_BLOCKS:
                    break
                if admission is Admission.PARKED:
                    self.waiting.pop(position)
                    continue
            cached_prefix = [] if request.block_ids else self.kv_cache.find_cached_prefix(request)
            num_computed = request.num_computed_tokens + len(cached_prefix) * self.kv_cache.block_size
            remaining = request.num_tokens_to_compute - num_computed
            num_new = chunks.size(request, remaining, step.budget)
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
            if num_new == 0 and connector is not None and self._hand_to_connector(connector, request):
                continue  # a prompt to send that the prefix cache holds whole
            step.copies.extend(new_copies)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            fair.admitted(request)
            step.scheduled[request.request_id] = ScheduledRequest(request, num_new)
            chunks.took(request, remaining, num_new)
            step.budget -= num_new
        for request in passed_over:
            bisect.insort(self.waiting, request, key=lambda r: r.sort_key)

    def _build_output(self, step: _Step) -> SchedulerOutput:
        """The step's output for the runner; the scheduler keeps the step's requests for `update`."""
        scheduled = step.scheduled
        output = SchedulerOutput(
            num_scheduled_tokens={request_id: item.num_new_tokens for request_id, item in scheduled.items()},
            block_copies=step.copies,
            finished_request_ids=self._finished_ids,
            preempted_request_ids=self._preempted_ids,
        )
        if self.connector is not None:
            output.kv_loads, output.kv_cancels = self.connector.take_step_work()
        for item in scheduled.values():
            data = describe(item.request)
            if isinstance(data, NewRequestData):
                output.new_requests.append(data)
            else:
                output.cached_requests.append(data)
        self._finished_ids, self._preempted_ids = [], []
        self._last_output, self._scheduled = output, list(scheduled.values())
        return output

    def update(
        self, output: SchedulerOutput, sampled_token_ids: dict[str, int], complete: AbstractSet[str] = frozenset()
    ) -> list[FinishedRequest]:
        """Advance the requests of `output`, the latest step, by what the model computed
        and sampled. The requests in `complete` (their output's grammar is complete) stop
        with their sampled token, before min_tokens or max_tokens."""
        if output is not self._last_output:
            raise ValueError("update() takes the output of the latest schedule()")
        scheduled, self._last_output, self._scheduled = self._scheduled, None, []
        connector = self.connector
        finished: list[FinishedRequest] = []
        for item in scheduled:
            request = item.request
            if request.is_finished:
                continue  # aborted while the step ran
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_computed_blocks(request)
            if connector is not None and request.remote_kv is not None and self._hand_to_connector(connector, request):
                continue
            if request.num_computed_tokens >= request.num_prompt_tokens:
                self._release_forks(request)
            token_id = sampled_token_ids.get(request.request_id)
            if token_id is None:
                continue
            request.append_output_token(token_id)
            status = request.check_stop(self.config.max_model_len)
            if request.request_id in complete:
                status = RequestStatus.FINISHED_STOPPED
            if status is not None:
                self.end_request(request, status)
                finished.append(FinishedRequest(request, status))
        return finished

    # ----- internals -----------------------------------------------------------------
    def _hand_to_connector(self, connector: SchedulerConnector, request: Request) -> bool:
        """Whether the connector takes a request whose tokens are computed; the runner
        then forgets it, and it leaves the scheduler's queues."""
        if not connector.update(request):
            return False
        if request in self.running:
            self.running.remove(request)
        request.runner_view = None
        self._finished_ids.append(request.request_id)
        return True

    def _preempt(self, victim: Request, scheduled: dict[str, ScheduledRequest]) -> int:
        """Free the victim and requeue it; returns the budget it had been given this step."""
        self.running.remove(victim)
        self.kv_cache.free(victim)
        victim.runner_view = None
        victim.num_preemptions += 1
        self.enqueue(victim)
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

    def _prompt_done(self, request_id: str) -> bool:
        request = self.requests[request_id]
        return request.num_computed_tokens >= request.num_prompt_tokens

    def _release_forks(self, parent: Request) -> None:
        for child in self.pending_forks.pop(parent.request_id, []):
            self.kv_cache.fork(parent, child)
            child.fork_parent_id = None
            self.enqueue(child)

    def check_integrity(self) -> None:
        """Assert the queues, statuses and the KV cache agree (tests call it every step)."""
        pending = [r for children in self.pending_forks.values() for r in children]
        parked = self.connector.parked_requests() if self.connector is not None else []
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
        if self.connector is not None:
            self.connector.check_integrity()
        assert self.waiting == sorted(self.waiting, key=lambda r: r.sort_key), "waiting out of order"
        self.kv_cache.check_integrity(tracked, self.connector.blocks_without_request() if self.connector else ())
