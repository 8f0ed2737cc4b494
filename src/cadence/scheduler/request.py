"""A request as the scheduler sees it: token ids, progress counters and a block table."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from cadence.scheduler.block_pool import BlockKey
from cadence.scheduler.remote_kv import RemoteKV


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    WAITING_FOR_KV = "waiting_for_kv"  # blocks reserved; the prompt's KV comes from another engine
    HOLDING_KV = "holding_kv"  # prompt computed for another engine, which reads the blocks
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_SENT = "finished_sent"  # its prompt KV was read by another engine

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI word for how a finished request ended."""
        return _FINISH_REASONS.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_SENT,
}
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass
class StopConditions:
    """When the scheduler ends a request on its own, without the detokenizer.

    `max_tokens` is already capped so that prompt + output fits in max_model_len.
    Stop token ids only count once at least `min_tokens` tokens were generated.
    """

    max_tokens: int
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()


@dataclass
class RunnerView:
    """How much of a request the model runner holds: its first `num_tokens` token ids and
    first `num_blocks` block ids (scheduler/output.py sends the rest)."""

    num_tokens: int
    num_blocks: int


@dataclass(eq=False)
class Request:
    """One sequence being generated.

    `token_ids` holds the prompt followed by every generated token. The KV of the first
    `num_computed_tokens` of them is in the blocks of `block_ids`. The last generated
    token is always uncomputed: it becomes the input of the next step.
    """

    request_id: str
    prompt_token_ids: list[int]
    stop: StopConditions
    arrival_seq: int
    priority: int = 0
    sampling_params: Any = None  # opaque to the scheduler; the model runner reads it
    # The request whose prompt KV this one will share (n > 1); None once forked.
    fork_parent_id: str | None = None
    # The client request this sequence is one of (its own id unless n > 1): the n
    # sequences of one client request share one request's part (scheduler/fair_share.py).
    client_request_id: str = ""
    skip_prefix_cache: bool = False  # prompt logprobs need every prompt position computed
    remote_kv: RemoteKV | None = None  # set when the prompt's KV crosses engines

    token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    block_ids: list[int] = field(default_factory=list)
    # Prefix-cache keys of the leading full blocks of token_ids, filled in lazily. Tokens
    # are only ever appended, so a full block's key never changes.
    block_keys: list[BlockKey] = field(default_factory=list)
    # How many of this request's leading blocks it has registered in the prefix cache.
    num_registered_blocks: int = 0
    stop_token_id: int | None = None  # the stop token that finished it, if any
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache on first admission
    # The most of its tokens one step computes (0: the scheduler's own limits); a router
    # that has a decode engine compute a prompt sets it so that its streams keep flowing.
    max_chunk_tokens: int = 0
    # What the model runner holds of this request; None while it holds nothing (before
    # admission, and after a preemption until the request is admitted again).
    runner_view: RunnerView | None = None
    # Indices into block_ids that copy-on-write swapped since the runner was last told.
    replaced_block_indices: list[int] = field(default_factory=list)
    # time.monotonic when it was queued and first scheduled (0: not yet), for metrics.
    queued_at: float = field(default_factory=time.monotonic)
    scheduled_at: float = 0.0
    prefix_lookup_counted: bool = False  # its first admission's prefix-cache lookup is in the totals

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        self.client_request_id = self.client_request_id or self.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def num_tokens_to_compute(self) -> int:
        """How many tokens end up computed here: all, or for a prompt sent to another
        engine all but the last, which that engine computes to sample from."""
        return self.num_tokens - 1 if self.remote_kv is RemoteKV.SEND else self.num_tokens

    @property
    def num_tokens_left(self) -> int:
        """How many of its tokens are still to compute here."""
        return self.num_tokens_to_compute - self.num_computed_tokens

    @property
    def sort_key(self) -> tuple[int, int]:
        """Lower sorts first: a smaller priority value, then earlier arrival."""
        return (self.priority, self.arrival_seq)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status this request has reached after its newest token, if any."""
        num_output = self.num_output_tokens
        last = self.token_ids[-1]
        if num_output >= self.stop.min_tokens and last in self.stop.stop_token_ids:
            self.stop_token_id = last
            return RequestStatus.FINISHED_STOPPED
        if num_output >= self.stop.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
