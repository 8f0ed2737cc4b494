"""What one engine step did, for the front end's metrics: whether it computed prompts,
decoded or both, how long it took, how many tokens and sequences it ran, and what its
admissions found in the prefix cache. It also stamps each sequence's first scheduling."""

from __future__ import annotations

import time

from cadence.engine.protocol import StepStats
from cadence.scheduler.kv_cache_manager import KVCacheManager
from cadence.scheduler.output import SchedulerOutput
from cadence.scheduler.request import Request


def step_kind(scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> str:
    """ "prefill", "decode" or "mixed", from the scheduled sequences before the step runs:
    one computing more than its newest token (a prompt, or a preempted sequence's
    recompute) does prompt work. Stamps first scheduling times on the way."""
    now = time.monotonic()
    prompt_work = decoding = 0
    for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
        request = requests[request_id]
        request.scheduled_at = request.scheduled_at or now
        if num_new > 1 or request.num_computed_tokens < request.num_prompt_tokens:
            prompt_work += 1
        else:
            decoding += 1
    if prompt_work and decoding:
        return "mixed"
    return "prefill" if prompt_work else "decode"


class StepRecorder:
    """Builds each step's StepStats; the prefix-cache figures are the step's share of the
    cache manager's running totals."""

    def __init__(self, kv_cache: KVCacheManager) -> None:
        self.kv_cache = kv_cache
        self._queries_seen = 0
        self._hits_seen = 0
        self.last: StepStats | None = None  # until taken

    def record(self, kind: str, seconds: float, scheduler_output: SchedulerOutput) -> None:
        queries, hits = self.kv_cache.prefix_cache_queries, self.kv_cache.prefix_cache_hits
        self.last = StepStats(
            kind=kind,
            seconds=seconds,
            ended_at=time.monotonic(),
            num_tokens=scheduler_output.num_batched_tokens,
            num_sequences=len(scheduler_output.num_scheduled_tokens),
            prefix_cache_queries=queries - self._queries_seen,
            prefix_cache_hits=hits - self._hits_seen,
        )
        self._queries_seen, self._hits_seen = queries, hits

    def take(self) -> StepStats | None:
        last, self.last = self.last, None
        return last
