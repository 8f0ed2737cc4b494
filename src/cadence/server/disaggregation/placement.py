"""Where a prompt is computed: on a prefill engine (its KV then moves), or on the decode
engine that will generate from it.

Remote prefill costs the prefill engine's queue, the prompt itself and the transfer;
local prefill costs the decode engine's own queue of local prompts and the prompt, and
stalls every stream the decode engine is generating for (and every load it is to
start) while a chunk of the prompt runs in its step. The cost model (`cost`) bounds that
stall: a prompt computed locally goes in chunks that add at most `max_local_stall`
seconds to a decode step, one per step, so the decode engine's streams keep flowing and a
prefill pool that cannot keep up borrows the decode engines' spare time. It computes the
prompt locally when that is not slower to the first token, counting the decode steps its
chunks share. Every estimate comes from what the engines measured: the prefill engines'
tokens per busy second, the decode engine's seconds per plain step and the prompt tokens
per second its chunk steps add (small chunks beside streams run slower per token than a
prefill engine's whole prompts), and the transfers' seconds per byte. Until a prefill
engine has worked it decides as `remote` does; until the decode engine has run a few
chunk steps its chunks are sized from the prefill engines' rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.engine.protocol import EngineStats
from cadence.server.disaggregation.transfer_stats import TransferStats, engine_rate

PLACEMENTS = ("cost", "remote", "local")


@dataclass(frozen=True)
class PlacementPolicy:
    """How the router places prompts.

    `remote` sends every prompt with at least `min_remote_prefill_tokens` uncached tokens
    to a prefill engine; `local` computes every prompt on its decode engine (a prefill
    pool that is being drained, or a baseline); `cost` weighs the two per prompt."""

    mode: str = "remote"
    min_remote_prefill_tokens: int = 1
    # Seconds one step of a local prompt may add to the decode engine's token streams:
    # a few decode steps' worth (bench/disagg.py measures what it costs).
    max_local_stall: float = 0.25

    def __post_init__(self) -> None:
        if self.mode not in PLACEMENTS:
            raise ValueError(f"unknown prefill placement {self.mode!r}; use {', '.join(PLACEMENTS)}")
        if self.min_remote_prefill_tokens < 1 or self.max_local_stall < 0:
            raise ValueError("min_remote_prefill_tokens must be at least 1 and max_local_stall not negative")


@dataclass(frozen=True)
class DecodeLoad:
    """What the router knows of one decode engine when a prompt arrives."""

    stats: EngineStats
    local_prompt_tokens: int  # prompts it was told to compute itself, until their first token
    chunk_tokens: int  # the most tokens one of its steps computes


# A local chunk smaller than this would spend its step mostly on the streams' tokens:
# the prompt then goes to a prefill engine, however long that one's queue.
MIN_LOCAL_CHUNK = 16
# Chunk steps a decode engine runs before its own prompt rate replaces the prefill
# engines' in the estimates: one step's figure mixes in too much else.
MIN_MEASURED_CHUNK_STEPS = 3


@dataclass(frozen=True)
class Placement:
    local: bool
    reason: str
    chunk_tokens: int = 0  # local: the most of the prompt one decode step computes (0: no cap)


def plain_step_seconds(stats: EngineStats) -> float:
    """Seconds of one of the engine's steps that computed one token per sequence."""
    plain = stats.num_steps - stats.num_chunk_steps
    if plain > 0:
        return max(stats.busy_seconds - stats.chunk_step_seconds, 0.0) / plain
    return stats.busy_seconds / stats.num_steps if stats.num_steps else 0.0


def local_prompt_rate(stats: EngineStats, prefill_rate: float) -> float:
    """Prompt tokens per second that a decode engine's steps add to their time: its chunk
    steps' tokens over what those steps took beyond plain ones. `prefill_rate` (the
    prefill engines') until it has run enough chunk steps and plain ones to tell."""
    if stats.num_chunk_steps < MIN_MEASURED_CHUNK_STEPS or stats.num_steps == stats.num_chunk_steps:
        return prefill_rate
    added = stats.chunk_step_seconds - stats.num_chunk_steps * plain_step_seconds(stats)
    return stats.num_chunk_tokens / added if added > 0 else prefill_rate


def local_chunk(policy: PlacementPolicy, rate: float, decode_chunk_tokens: int) -> int:
    """Tokens of a prompt computed on a decode engine per step: what it adds to a step in
    `max_local_stall` seconds at `rate`, within the decode engine's own step limit."""
    return min(int(rate * policy.max_local_stall), decode_chunk_tokens)


def place_prompt(
    policy: PlacementPolicy,
    uncached_tokens: int,
    decode: DecodeLoad,
    prefill_queues: list[int],
    prefill_stats: list[EngineStats],
    transfer: TransferStats,
    bytes_per_token: int,
) -> Placement:
    """Decide where a prompt with `uncached_tokens` to compute goes; `prefill_queues` are
    the live prefill engines' queued prompt tokens."""
    if policy.mode == "local":
        return Placement(True, "prefill placement is local")
    if not prefill_queues:
        return Placement(True, "no prefill engine is available")
    if uncached_tokens < policy.min_remote_prefill_tokens:
        return Placement(True, "the uncached part is short")
    rate = engine_rate(prefill_stats, "num_computed_tokens")
    if policy.mode == "remote" or rate <= 0:
        return Placement(False, "remote")
    seconds_per_byte = transfer.latency.total / transfer.bytes_transferred if transfer.bytes_transferred else 0.0
    remote = (min(prefill_queues) + uncached_tokens) / rate + uncached_tokens * bytes_per_token * seconds_per_byte
    local_rate = local_prompt_rate(decode.stats, rate)
    # Chunked even while nothing streams: requests that arrive meanwhile would wait.
    chunk = local_chunk(policy, local_rate, decode.chunk_tokens)
    if chunk < min(uncached_tokens, MIN_LOCAL_CHUNK):
        return Placement(False, f"a local step of {policy.max_local_stall:g} s holds only {chunk} tokens")
    pending = decode.local_prompt_tokens + uncached_tokens
    # Each chunk shares its step with the streams' tokens, if any stream runs.
    step = plain_step_seconds(decode.stats) if decode.stats.num_running > 0 else 0.0
    local = pending / local_rate + -(-pending // chunk) * step
    if local > remote:
        return Placement(False, f"remote is sooner ({remote:.3f} s against {local:.3f} s)")
    chunk_tokens = chunk if uncached_tokens > chunk else 0
    return Placement(
        True, f"local is as soon ({local:.3f} s against {remote:.3f} s), {chunk} tokens a step", chunk_tokens
    )
