"""What one engine step did, for the front end's metrics: whether it computed prompts,
decoded or both, how long it took, how many tokens and sequences it ran, and what its
admissions found in the prefix cache, and what expert offloading did; when each sequence
was first scheduled; and the seconds each phase of the steps took (StepTimings)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cadence.engine.experts.stats import ExpertStats
from cadence.engine.protocol import StepStats
from cadence.scheduler.kv_cache_manager import KVCacheManager
from cadence.scheduler.output import SchedulerOutput
from cadence.scheduler.request import Request


@dataclass
class StepTimings:
    """Seconds spent in each phase of the steps so far, for the overhead benchmark."""

    schedule: float = 0.0
    execute: float = 0.0
    update: float = 0.0
    num_steps: int = 0
    num_computed_tokens: int = 0
    num_sampled_tokens: int = 0
    # Steps in which some sequence computed more than one token (a prompt or its chunk),
    # their seconds, and the tokens beyond one per sequence: how fast this engine adds
    # prompt tokens to a step, which a router sizes local prompt chunks by.
    num_chunk_steps: int = 0
    chunk_step_seconds: float = 0.0
    num_chunk_tokens: int = 0


def step_kind(scheduler_output: SchedulerOutput) -> str:
    """ "prefill", "decode" or "mixed": a sequence that computes one token this step
    decodes (a prompt's one-token remainder is as cheap, and counts so too), one that
    computes more (a prompt chunk, or a preempted sequence's recompute) does prompt work."""
    counts = scheduler_output.num_scheduled_tokens
    if scheduler_output.num_batched_tokens == len(counts):
        return "decode"
    return "mixed" if 1 in counts.values() else "prefill"


def mark_first_scheduled(scheduler_output: SchedulerOutput, requests: dict[str, Request]) -> None:
    """Stamp when each sequence was first scheduled: only requests new to the runner can
    be (a preempted one comes back new too, and keeps its first time)."""
    now = time.monotonic()
    for new in scheduler_output.new_requests:
        request = requests[new.request_id]
        request.scheduled_at = request.scheduled_at or now


class StepRecorder:
    """Builds each step's StepStats; the prefix-cache figures are the step's share of the
    cache manager's running totals."""

    def __init__(self, kv_cache: KVCacheManager, expert_stats: ExpertStats | None = None) -> None:
        self.kv_cache = kv_cache
        self.expert_stats = expert_stats
        if expert_stats is not None:
            expert_stats.take_step()  # what the start-up warm-up did is no step's
        self._queries_seen = 0
        self._hits_seen = 0
        self.last: StepStats | None = None  # until taken

    def record(self, seconds: float, scheduler_output: SchedulerOutput) -> None:
        queries, hits = self.kv_cache.prefix_cache_queries, self.kv_cache.prefix_cache_hits
        self.last = StepStats(
            kind=step_kind(scheduler_output),
            seconds=seconds,
            ended_at=time.monotonic(),
            num_tokens=scheduler_output.num_batched_tokens,
            num_sequences=len(scheduler_output.num_scheduled_tokens),
            prefix_cache_queries=queries - self._queries_seen,
            prefix_cache_hits=hits - self._hits_seen,
            experts=None if self.expert_stats is None else self.expert_stats.take_step(),
        )
        self._queries_seen, self._hits_seen = queries, hits

    def take(self) -> StepStats | None:
        last, self.last = self.last, None
        return last
