"""The messages that cross the boundary between a front end and an EngineCore.

The offline `LLM` calls the core in-process with these dataclasses; the server sends the
same dataclasses over ZMQ, packed with msgpack by `encode` / `decode` below. Nothing else
crosses the boundary.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

from cadence.engine.experts.stats import ExpertStepStats
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.sampling_params import SamplingParams
from cadence.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from cadence.scheduler.remote_kv import KVLoad, KVLoadOutcome, KVPrefilled, KVReservation
from cadence.structured_outputs.params import StructuredOutputsParams

# Per position: the chosen token first, then the top alternatives, as parallel lists,
# and the chosen token's rank (1 = most likely). Over the wire the tuple becomes a list.
TokenLogprobs = tuple[list[int], list[float], int]


@dataclass
class EngineCoreRequest:
    """A validated request: token ids in, sampling settings, and scheduling priority."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    # "load": a decode engine loads the prompt's KV from a prefill engine; "send": a
    # prefill engine computes it for one (scheduler/remote_kv.py). None: served whole.
    remote_kv: str | None = None


@dataclass
class EngineCoreOutput:
    """What one step produced for one sequence (`index` < n) of a request."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    # Prompt logprobs of the positions computed this step; position 0 never has one.
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length" or "abort"
    stop_reason: int | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0
    # With a sequence's first token only: when the engine queued it and first scheduled
    # it (time.monotonic in the engine process; compare only with StepStats.ended_at).
    queued_at: float = 0.0
    scheduled_at: float = 0.0
    # Finished ("stop") because its structured output's grammar is complete on a text
    # token, which stays in the text (a grammar ended by EOS or a stop token ends as they do).
    completed_grammar: bool = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class EngineStats:
    """Gauges a front end can show or export."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    num_steps: int = 0
    num_waiting_for_kv: int = 0  # parked on reserved blocks until their prompt KV arrives
    num_holding_kv: int = 0  # prompts computed for other engines, held until read
    # Cumulative work, from which a router derives each engine's prefill and decode rates.
    num_computed_tokens: int = 0  # tokens through the model (prompt chunks and decodes)
    num_sampled_tokens: int = 0
    busy_seconds: float = 0.0  # time spent in steps
    num_expired_kv: int = 0  # waits for KV and holds of KV that ran out of time
    # Steps that computed more than one token of some sequence, their seconds, and the
    # tokens beyond one per sequence in them (StepTimings).
    num_chunk_steps: int = 0
    chunk_step_seconds: float = 0.0
    num_chunk_tokens: int = 0


# ----- messages that only the multi-process engine needs ------------------------------
@dataclass
class AbortRequests:
    """Abort whole requests by id, and single sequences of n > 1 requests by (id, index)."""

    request_ids: list[str] = field(default_factory=list)
    sequences: list[tuple[str, int]] = field(default_factory=list)


@dataclass
class LoadKV:
    """To a decode engine: a parked request's prompt KV is in `block_ids` of `source`."""

    request_id: str
    source: KVSource
    block_ids: list[int]


@dataclass
class ReleaseKV:
    """To a prefill engine: the readers of these prompts' KV are done, or gone."""

    request_ids: list[str]


@dataclass
class CancelKVWait:
    """To a decode engine: this KV will not come; compute what is missing here, at most
    `chunk_tokens` of each prompt a step when that is set (0: the engine's own limits)."""

    request_ids: list[str]
    reason: str
    chunk_tokens: int = 0


@dataclass
class ExtendKVWait:
    """To a decode engine: the prefill engine computing these prompts lives and works;
    wait `kv_wait_timeout` more from now (its own deadline only catches lost messages)."""

    request_ids: list[str]


@dataclass
class Shutdown:
    """Ask the engine process to stop after the current step."""


@dataclass
class EngineReady:
    """The engine's first message: what the front end must know to validate requests."""

    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    device: str
    dtype: str
    num_kv_blocks: int
    kv_role: str = "colocated"
    kv_layout: KVLayout | None = None  # how this engine's KV blocks lie (disaggregated roles)
    kv_source: KVSource | None = None  # where a prefill engine's blocks are read from
    kv_wait_timeout: float = 0.0
    kv_hold_timeout: float = 0.0
    max_num_batched_tokens: int = 0  # the most tokens one step computes
    long_prefill_token_threshold: int = 0  # the most of one prompt's tokens a step computes (0: no cap)
    block_size: int = 0
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True


@dataclass
class StepStats:
    """One engine step, for the front end's metrics."""

    kind: str  # "prefill" (only prompt work), "decode" (one token per sequence) or "mixed"
    seconds: float
    ended_at: float  # time.monotonic in the engine process
    num_tokens: int  # tokens through the model
    num_sequences: int
    # Admissions this step: prompt tokens looked up in the prefix cache, and found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    experts: ExpertStepStats | None = None  # what expert offloading did (None: no layer offloads)


@dataclass
class EngineCoreOutputs:
    """One step's outputs for every sequence that gained something, and the gauges after it."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    # Requests the engine refused (request id -> reason); their streams end with an error.
    rejected: dict[str, str] = field(default_factory=dict)
    # Prompt KV across engines (scheduler/remote_kv.py), by client request id.
    kv_reserved: list[KVReservation] = field(default_factory=list)
    kv_prefilled: list[KVPrefilled] = field(default_factory=list)
    kv_loaded: list[KVLoadOutcome] = field(default_factory=list)
    step: StepStats | None = None  # None when the message reports no step


@dataclass
class LinkHello:
    """Router to worker, first on a new link: `session` names the link; the worker answers
    with its engine's EngineReady, or EngineDead while it has none (server/disaggregation/worker_link.py)."""

    session: str


@dataclass
class LinkHeartbeat:
    """Either way over a router-worker link, when nothing else was sent for a while;
    `draining` from a worker that is shutting down: send it no new requests."""

    draining: bool = False


@dataclass
class LinkGoodbye:
    """Router to worker: this session is over; everything it started is aborted."""


@dataclass
class EngineDead:
    """The engine hit an error it cannot recover from and is exiting."""

    message: str


Message = (
    EngineCoreRequest
    | AbortRequests
    | Shutdown
    | EngineReady
    | EngineCoreOutputs
    | EngineDead
    | SchedulerOutput  # a scheduler step for a runner in another process
    | LoadKV
    | ReleaseKV
    | CancelKVWait
    | ExtendKVWait
    | LinkHello
    | LinkHeartbeat
    | LinkGoodbye
)

# Wire codes. Append only: a code never changes meaning.
_CODES: dict[type, int] = {
    SamplingParams: 1,
    EngineCoreRequest: 2,
    EngineCoreOutput: 3,
    EngineStats: 4,
    AbortRequests: 5,
    Shutdown: 6,
    EngineReady: 7,
    EngineCoreOutputs: 8,
    EngineDead: 9,
    # What a scheduler tells a model runner that may live in another process.
    NewRequestData: 10,
    CachedRequestData: 11,
    SchedulerOutput: 12,
    # Prompt KV across engines.
    KVLayout: 13,
    KVSource: 14,
    KVLoad: 15,
    KVReservation: 16,
    KVPrefilled: 17,
    KVLoadOutcome: 18,
    LoadKV: 19,
    ReleaseKV: 20,
    CancelKVWait: 21,
    # A router's link to a worker on another host.
    LinkHello: 22,
    LinkHeartbeat: 23,
    LinkGoodbye: 24,
    ExtendKVWait: 25,
    StepStats: 26,
    ExpertStepStats: 27,
    StructuredOutputsParams: 28,
}
_TYPES = {code: cls for cls, code in _CODES.items()}


def _pack_dataclass(obj: Any) -> msgpack.ExtType:
    code = _CODES.get(type(obj))
    if code is None:
        raise TypeError(f"{type(obj).__name__} cannot cross the engine boundary")
    # Positional field values: compact, and the receiver rebuilds through __init__, so
    # SamplingParams validates again on the engine side.
    values = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return msgpack.ExtType(code, msgpack.packb(values, default=_pack_dataclass, use_bin_type=True))


def _unpack_dataclass(code: int, data: bytes) -> Any:
    cls = _TYPES.get(code)
    if cls is None:
        raise ValueError(f"unknown message code {code}")
    values = msgpack.unpackb(data, ext_hook=_unpack_dataclass, raw=False, strict_map_key=False)
    return cls(*values)


def encode(message: Message) -> bytes:
    """Pack a message (and the dataclasses inside it) into bytes."""
    return msgpack.packb(message, default=_pack_dataclass, use_bin_type=True)


def decode(data: bytes) -> Message:
    """Rebuild a message packed by `encode`."""
    return msgpack.unpackb(data, ext_hook=_unpack_dataclass, raw=False, strict_map_key=False)
