"""What one step tells the model runner: only what changed since the runner last heard.

The runner keeps its own copy of every request it runs (token ids, block table, sampling
settings) and never reads the scheduler's `Request` objects, so it can live in another
process. Each step therefore carries:

* `NewRequestData` for a request the runner does not hold: one admitted for the first
  time, or again after preemption (its tokens then include what it generated before);
* `CachedRequestData` for one it holds: the tokens and blocks appended since it was last
  sent, and the blocks that copy-on-write replaced in place;
* the ids preempted or finished since the last step, whose runner state goes.

Building a step costs O(what changed): each request remembers how many of its tokens and
blocks the runner has (`RunnerView`), and `KVCacheManager` notes copy-on-write swaps as
they happen. Every field is a plain value, so a `SchedulerOutput` pickles and msgpacks
(engine/protocol.py registers these classes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cadence.scheduler.kv_cache_manager import BlockCopy
from cadence.scheduler.remote_kv import KVLoad
from cadence.scheduler.request import Request, RunnerView


@dataclass(slots=True)
class NewRequestData:
    """A request the runner does not hold yet, whole."""

    request_id: str
    token_ids: list[int]  # the prompt, then any tokens generated before a preemption
    num_prompt_tokens: int
    sampling_params: Any  # opaque to the scheduler; the runner's sampler reads it
    stop_token_ids: list[int]  # every id that ends the request (min_tokens holds them back)
    block_ids: list[int]
    num_computed_tokens: int  # where this step's tokens start (after any prefix-cache hit)


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner holds: what changed since it was last sent."""

    request_id: str
    new_token_ids: list[int]  # appended to its token ids
    new_block_ids: list[int]  # appended to its block table
    replaced_blocks: list[tuple[int, int]]  # (index, block id): copy-on-write swapped these in place
    num_computed_tokens: int  # where this step's tokens start


@dataclass
class SchedulerOutput:
    """One step's work for the model runner.

    The runner applies `finished_request_ids` and `preempted_request_ids` first (an id can
    come back as a new request in the same step), then `new_requests`, then
    `cached_requests`; `block_copies` run before the forward writes anything.
    """

    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    # Tokens computed this step per request id, in scheduling order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    block_copies: list[BlockCopy] = field(default_factory=list)
    # Finished or aborted since the last step: the runner forgets them entirely.
    finished_request_ids: list[str] = field(default_factory=list)
    # Preempted this step: the runner drops their rows, keeping what outlives a preemption
    # (random generators, prompt positions already scored).
    preempted_request_ids: list[str] = field(default_factory=list)
    # Prompt KV to copy in from other engines, into blocks no scheduled request touches,
    # and loads to stop (each reports a result either way).
    kv_loads: list[KVLoad] = field(default_factory=list)
    kv_cancels: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


def describe(request: Request) -> NewRequestData | CachedRequestData:
    """What the runner must learn about a scheduled request, and note that it has."""
    view = request.runner_view
    token_ids, block_ids = request.token_ids, request.block_ids
    if view is None:
        request.runner_view = RunnerView(len(token_ids), len(block_ids))
        request.replaced_block_indices.clear()  # a new request gets its blocks whole
        return NewRequestData(
            request_id=request.request_id,
            token_ids=list(token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            sampling_params=request.sampling_params,
            stop_token_ids=sorted(request.stop.stop_token_ids),
            block_ids=list(block_ids),
            num_computed_tokens=request.num_computed_tokens,
        )
    # Only appends and in-place swaps reach a request the runner holds; anything that
    # rewinds it (preemption, finishing) drops the view first.
    assert len(block_ids) >= view.num_blocks and len(token_ids) >= view.num_tokens, request.request_id
    replaced: list[tuple[int, int]] = []
    if request.replaced_block_indices:
        replaced = [(i, block_ids[i]) for i in sorted(set(request.replaced_block_indices)) if i < view.num_blocks]
        request.replaced_block_indices.clear()
    data = CachedRequestData(
        request_id=request.request_id,
        new_token_ids=token_ids[view.num_tokens :],
        new_block_ids=block_ids[view.num_blocks :],
        replaced_blocks=replaced,
        num_computed_tokens=request.num_computed_tokens,
    )
    view.num_tokens, view.num_blocks = len(token_ids), len(block_ids)
    return data
