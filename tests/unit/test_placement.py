"""Where the router computes a prompt (server/disaggregation/placement.py): the cost model's
decisions from measured rates, queues and transfer costs, and the coordinator acting on
them (a prompt kept local counts in its decode engine's queue until its first token)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import pytest

from cadence.engine.protocol import (
    CancelKVWait,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    Message,
    decode,
    encode,
)
from cadence.engine.sampling_params import SamplingParams
from cadence.scheduler.remote_kv import KVReservation
from cadence.server.disaggregation.coordinator import Coordinator, Phase
from cadence.server.disaggregation.placement import DecodeLoad, Placement, PlacementPolicy, place_prompt
from cadence.server.disaggregation.transfer_stats import TransferStats
from tests.unit.test_coordinator import LAYOUT, ready

COST = PlacementPolicy("cost", max_local_stall=0.1)
# A prefill engine that computed 1,000 tokens per busy second.
MEASURED = [EngineStats(num_computed_tokens=5000, busy_seconds=5.0)]
STREAMING = EngineStats(num_running=3)


def transfer(seconds_per_byte: float) -> TransferStats:
    stats = TransferStats()
    stats.observe_load(seconds_per_byte * 1e6, True, 1_000_000)
    return stats


def place(
    uncached: int,
    decode: DecodeLoad,
    queues: Sequence[int] = (0,),
    stats: Sequence[EngineStats] = MEASURED,
    moved: TransferStats | None = None,
    policy: PlacementPolicy = COST,
) -> Placement:
    return place_prompt(policy, uncached, decode, list(queues), list(stats), moved or transfer(0.0), 1000)


def test_before_any_measurement_prompts_go_to_prefill_engines() -> None:
    assert not place(50, DecodeLoad(STREAMING, 0, 2048), stats=[]).local


@pytest.mark.parametrize(
    ("policy", "local"), [(PlacementPolicy("remote"), False), (PlacementPolicy("local"), True), (COST, True)]
)
def test_fixed_policies_ignore_the_costs(policy: PlacementPolicy, local: bool) -> None:
    assert place(50, DecodeLoad(STREAMING, 0, 2048), policy=policy).local is local


def test_a_local_prompt_runs_in_chunks_of_the_stall_limit() -> None:
    """1,000 tokens per second and 0.1 s a step: 100-token chunks, when local is no later."""
    decision = place(500, DecodeLoad(STREAMING, 0, 2048), moved=transfer(1e-7))
    assert decision.local and decision.chunk_tokens == 100
    assert place(500, DecodeLoad(STREAMING, 0, 40), moved=transfer(1e-7)).chunk_tokens == 40  # the engine's own cap
    assert place(60, DecodeLoad(STREAMING, 0, 2048), moved=transfer(1e-7)).chunk_tokens == 0  # one step holds it
    # Five chunks share five decode steps of 50 ms: 0.75 s locally against 0.55 s remote.
    busy = DecodeLoad(EngineStats(num_running=3, num_steps=10, busy_seconds=0.5), 0, 2048)
    decision = place(500, busy, moved=transfer(1e-7))
    assert not decision.local and "remote is sooner" in decision.reason
    assert place(500, busy, queues=(1000,), moved=transfer(1e-7)).local  # unless the prefill queue is long
    assert not place(500, DecodeLoad(STREAMING, 1100, 2048), queues=(1000,)).local  # or its own queue is longer


def test_the_decode_engines_own_chunk_steps_size_its_chunks() -> None:
    """Beside streams, a chunk runs slower per token than a prefill engine's whole prompt:
    once the decode engine has measured its chunk steps, chunks and estimates use them."""
    # 20 plain steps of 20 ms; 5 chunk steps of 220 ms that added 200 prompt tokens: each
    # 200 ms beyond a plain step for 40 tokens, 200 tokens a second (the prefill engine: 1,000).
    measured = EngineStats(
        num_running=3, num_steps=25, busy_seconds=1.5, num_chunk_steps=5, chunk_step_seconds=1.1, num_chunk_tokens=200
    )
    decision = place(500, DecodeLoad(measured, 0, 2048), queues=(5000,))
    assert decision.local and decision.chunk_tokens == 20  # 0.1 s at 200 tokens a second
    # Local: 500 / 200 + 25 plain steps = 3.0 s; remote: 5.5 s of queue, or 2.5 s without it.
    assert not place(500, DecodeLoad(measured, 0, 2048), queues=(2000,)).local
    few = replace(measured, num_steps=22, busy_seconds=0.84, num_chunk_steps=2, chunk_step_seconds=0.44)
    assert place(500, DecodeLoad(few, 0, 2048), queues=(5000,)).chunk_tokens == 100  # too few steps to tell


def test_chunks_too_small_to_be_worth_a_step_send_the_prompt_away() -> None:
    tight = PlacementPolicy("cost", max_local_stall=0.01)  # 10 tokens a step
    decision = place(500, DecodeLoad(STREAMING, 0, 2048), queues=(5000,), policy=tight)
    assert not decision.local and "holds only 10 tokens" in decision.reason
    assert place(8, DecodeLoad(STREAMING, 0, 2048), queues=(5000,), policy=tight).local  # it fits one step


def test_streams_make_a_long_local_prompt_pay_for_their_steps() -> None:
    """Idle, the decode engine takes a prompt its transfer would delay; with streams each
    chunk also waits for their tokens (20 ms steps here), and the prompt moves."""
    idle = DecodeLoad(EngineStats(num_steps=10, busy_seconds=0.2), 0, 2048)
    assert place(90, idle, moved=transfer(1e-7)).local
    assert place(3000, idle, moved=transfer(1e-7)).local  # 3.0 s here, 3.3 s with the transfer
    streaming = DecodeLoad(EngineStats(num_running=3, num_steps=10, busy_seconds=0.2), 0, 2048)
    assert not place(3000, streaming, moved=transfer(1e-7)).local  # 3.0 s + 30 steps of 20 ms
    assert not place(90, DecodeLoad(EngineStats(), 4000, 2048), moved=transfer(1e-7)).local


def test_a_backed_up_prefill_pool_keeps_short_prompts_local() -> None:
    assert place(80, DecodeLoad(STREAMING, 0, 2048), queues=(5000, 7000)).local
    assert not place(80, DecodeLoad(STREAMING, 9000, 2048), queues=(5000, 7000)).local
    assert place(80, DecodeLoad(STREAMING, 0, 2048), queues=()).local  # no prefill engine at all


def test_the_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError, match="placement"):
        PlacementPolicy("sometimes")
    with pytest.raises(ValueError):
        PlacementPolicy("cost", max_local_stall=-1.0)


def test_the_coordinator_places_by_cost_and_counts_local_prompts() -> None:
    sent: list[tuple[str, Message]] = []
    coordinator = Coordinator(lambda engine, message: sent.append((engine, message)), COST)
    coordinator.add_engine("p0", ready("prefill"))
    coordinator.add_engine("d0", ready("decode"))
    assert LAYOUT.bytes_per_token > 0
    coordinator.on_outputs("p0", EngineCoreOutputs([], MEASURED[0]))
    coordinator.on_outputs("d0", EngineCoreOutputs([], STREAMING))
    params = SamplingParams(max_tokens=4)
    coordinator.add_request(EngineCoreRequest("short", list(range(1, 61)), params))
    coordinator.on_outputs("d0", EngineCoreOutputs([], STREAMING, kv_reserved=[KVReservation("short", 0, 59)]))
    assert isinstance(sent[-1][1], CancelKVWait) and coordinator.routes["short"].local_tokens_pending == 59
    coordinator.add_request(EngineCoreRequest("long", list(range(1, 241)), params))
    coordinator.on_outputs("d0", EngineCoreOutputs([], STREAMING, kv_reserved=[KVReservation("long", 0, 239)]))
    engine, message = sent[-1]
    assert engine == "p0" and isinstance(message, EngineCoreRequest) and message.remote_kv == "send"
    assert coordinator.routes["long"].phase is Phase.PREFILLING
    first = EngineCoreOutput("short", 0, [5])
    coordinator.on_outputs("d0", EngineCoreOutputs([first], STREAMING))
    assert coordinator.routes["short"].local_tokens_pending == 0
    # With "long" queued on the prefill engine, the next long prompt is sooner here, in
    # chunks of 0.1 s at the prefill engine's 1,000 tokens a second.
    coordinator.add_request(EngineCoreRequest("next", list(range(1, 241)), params))
    coordinator.on_outputs("d0", EngineCoreOutputs([], STREAMING, kv_reserved=[KVReservation("next", 0, 239)]))
    engine, message = sent[-1]
    assert engine == "d0" and isinstance(message, CancelKVWait) and message.chunk_tokens == 100


def test_local_placement_sends_plain_requests() -> None:
    sent: list[tuple[str, Message]] = []
    coordinator = Coordinator(lambda engine, message: sent.append((engine, message)), PlacementPolicy("local"))
    coordinator.add_engine("p0", ready("prefill"))
    coordinator.add_engine("d0", ready("decode"))
    coordinator.add_request(EngineCoreRequest("r", list(range(1, 100)), SamplingParams(max_tokens=4)))
    assert len(sent) == 1 and sent[0][0] == "d0" and sent[0][1].remote_kv is None  # type: ignore[union-attr]
    assert coordinator.stats.num_local_prefills == 1


def test_a_prompt_falling_back_to_its_decode_engine_is_chunked_too() -> None:
    """Always-remote placement, but the prefill engine refuses the prompt: the decode
    engine computes it, in the chunks the stall limit allows at the measured rate."""
    sent: list[tuple[str, Message]] = []
    policy = PlacementPolicy("remote", max_local_stall=0.1)
    coordinator = Coordinator(lambda engine, message: sent.append((engine, message)), policy)
    coordinator.add_engine("p0", ready("prefill"))
    coordinator.add_engine("d0", ready("decode"))
    coordinator.on_outputs("p0", EngineCoreOutputs([], MEASURED[0]))
    coordinator.add_request(EngineCoreRequest("r", list(range(1, 601)), SamplingParams(max_tokens=4)))
    coordinator.on_outputs("d0", EngineCoreOutputs([], STREAMING, kv_reserved=[KVReservation("r", 0, 599)]))
    assert sent[-1][0] == "p0"
    coordinator.on_outputs("p0", EngineCoreOutputs([], MEASURED[0], rejected={"r": "no room"}))
    engine, message = sent[-1]
    assert engine == "d0" and isinstance(message, CancelKVWait) and message.chunk_tokens == 100


def test_the_chunk_and_the_step_limit_cross_the_wire() -> None:
    assert decode(encode(CancelKVWait(["r"], "placed here", 100))) == CancelKVWait(["r"], "placed here", 100)
    limited = replace(ready("decode"), long_prefill_token_threshold=64)
    assert decode(encode(limited)) == limited
