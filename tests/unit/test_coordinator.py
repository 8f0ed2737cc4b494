"""The router's state machine on its own: the messages it sends for each event, in order,
including events that arrive twice, late, from the wrong engine, or after a refusal."""

from __future__ import annotations

import time

import pytest

from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.protocol import (
    AbortRequests,
    CancelKVWait,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineReady,
    EngineStats,
    ExtendKVWait,
    LoadKV,
    Message,
    ReleaseKV,
)
from cadence.engine.sampling_params import SamplingParams
from cadence.scheduler.remote_kv import KVLoadOutcome, KVPrefilled, KVReservation
from cadence.server.disaggregation.coordinator import Coordinator, NoEngineError, Phase
from cadence.server.disaggregation.placement import PlacementPolicy
from cadence.server.disaggregation.transfer_stats import recommended_prefill_decode_ratio

LAYOUT = KVLayout("weights", 2, 4, 2, 8, "float32", "auto")


def ready(role: str, layout: KVLayout = LAYOUT, wait: float = 30.0, hold: float = 60.0) -> EngineReady:
    source = KVSource("in-process", f"at-{role}", layout) if role == "prefill" else None
    return EngineReady(256, 512, 8, "cpu", "float32", 100, role, layout, source, wait, hold)


def events(
    reserved: list[KVReservation] | None = None,
    prefilled: list[KVPrefilled] | None = None,
    loaded: list[KVLoadOutcome] | None = None,
    rejected: dict[str, str] | None = None,
) -> EngineCoreOutputs:
    return EngineCoreOutputs([], EngineStats(), rejected or {}, reserved or [], prefilled or [], loaded or [])


@pytest.fixture
def sent() -> list[tuple[str, Message]]:
    return []


@pytest.fixture
def coordinator(sent: list[tuple[str, Message]]) -> Coordinator:
    coordinator = Coordinator(
        lambda engine, message: sent.append((engine, message)), PlacementPolicy(min_remote_prefill_tokens=4)
    )
    coordinator.add_engine("p0", ready("prefill"))
    coordinator.add_engine("p1", ready("prefill"))
    coordinator.add_engine("d0", ready("decode"))
    return coordinator


def request(request_id: str = "r", length: int = 20) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, list(range(1, length + 1)), SamplingParams(max_tokens=4))


def to_loading(coordinator: Coordinator, sent: list) -> None:
    coordinator.add_request(request())
    coordinator.on_outputs("d0", events(reserved=[KVReservation("r", 0, 19)]))
    coordinator.on_outputs("p0", events(prefilled=[KVPrefilled("r", [3, 4, 5, 6, 7], 19)]))
    assert isinstance(sent[-1][1], LoadKV) and coordinator.routes["r"].phase is Phase.LOADING
    sent.clear()


def test_the_happy_path_sends_each_message_once(coordinator: Coordinator, sent: list) -> None:
    assert coordinator.add_request(request()) == "d0"
    message = sent[-1][1]
    assert sent[-1][0] == "d0" and isinstance(message, EngineCoreRequest) and message.remote_kv == "load"
    coordinator.on_outputs("d0", events(reserved=[KVReservation("r", 8, 19)]))
    engine, message = sent[-1]
    assert engine == "p0" and isinstance(message, EngineCoreRequest) and message.remote_kv == "send"
    coordinator.on_outputs("p0", events(prefilled=[KVPrefilled("r", [3, 4, 5, 6, 7], 19)]))
    engine, message = sent[-1]
    assert engine == "d0" and isinstance(message, LoadKV) and message.block_ids == [3, 4, 5, 6, 7]
    coordinator.on_outputs("d0", events(loaded=[KVLoadOutcome("r", 19, 19, None)]))
    assert sent[-1] == ("p0", ReleaseKV(["r"]))
    assert coordinator.routes["r"].phase is Phase.DECODING and len(sent) == 4


def test_short_uncached_part_is_computed_on_the_decode_engine(coordinator: Coordinator, sent: list) -> None:
    coordinator.add_request(request())
    coordinator.on_outputs("d0", events(reserved=[KVReservation("r", 16, 19)]))  # 3 uncached < 4
    assert isinstance(sent[-1][1], CancelKVWait) and coordinator.routes["r"].phase is Phase.DECODING


def test_a_repeated_prefilled_event_does_not_release_kv_being_read(coordinator: Coordinator, sent: list) -> None:
    to_loading(coordinator, sent)
    coordinator.on_outputs("p0", events(prefilled=[KVPrefilled("r", [3, 4, 5, 6, 7], 19)]))
    assert sent == []


def test_decode_giving_up_mid_prefill_aborts_the_prefill(coordinator: Coordinator, sent: list) -> None:
    coordinator.add_request(request())
    coordinator.on_outputs("d0", events(reserved=[KVReservation("r", 0, 19)]))
    coordinator.on_outputs("d0", events(loaded=[KVLoadOutcome("r", 0, 19, "no KV arrived within 30 s")]))
    assert sent[-1] == ("p0", AbortRequests(["r"]))
    # The prompt computed anyway is released when it turns up.
    coordinator.on_outputs("p0", events(prefilled=[KVPrefilled("r", [3], 19)]))
    assert sent[-1] == ("p0", ReleaseKV(["r"]))


def test_events_from_other_engines_are_ignored(coordinator: Coordinator, sent: list) -> None:
    coordinator.add_engine("d1", ready("decode"))
    coordinator.add_request(request())
    route = coordinator.routes["r"]
    other = "d1" if route.decode == "d0" else "d0"
    count = len(sent)
    coordinator.on_outputs(other, events(reserved=[KVReservation("r", 0, 19)]))
    assert len(sent) == count and route.phase is Phase.RESERVING


def test_a_decode_refusal_drops_the_route(coordinator: Coordinator, sent: list) -> None:
    coordinator.add_request(request())
    coordinator.on_outputs("d0", events(rejected={"r": "the prompt is too long"}))
    assert "r" not in coordinator.routes


def test_a_prefill_refusal_computes_on_the_decode_engine(coordinator: Coordinator, sent: list) -> None:
    coordinator.add_request(request())
    coordinator.on_outputs("d0", events(reserved=[KVReservation("r", 0, 19)]))
    coordinator.on_outputs("p0", events(rejected={"r": "no"}))
    assert isinstance(sent[-1][1], CancelKVWait) and sent[-1][0] == "d0"


def test_dead_prefill_engine_reroutes_and_dead_decode_loses_its_requests(coordinator: Coordinator, sent: list) -> None:
    coordinator.add_request(request())
    coordinator.on_outputs("d0", events(reserved=[KVReservation("r", 0, 19)]))
    assert coordinator.remove_engine("p0") == []
    assert sent[-1][0] == "p1" and coordinator.stats.num_rerouted == 1
    coordinator.remove_engine("p1")
    assert isinstance(sent[-1][1], CancelKVWait), "no prefill engine left: computed on the decode engine"
    assert coordinator.remove_engine("d0") == ["r"]
    with pytest.raises(NoEngineError):
        coordinator.add_request(request("s"))


def test_admission_checks_layouts_deadlines_and_ids(coordinator: Coordinator) -> None:
    with pytest.raises(ValueError, match="block_size"):
        coordinator.add_engine("d9", ready("decode", KVLayout("weights", 2, 8, 2, 8, "float32", "auto")))
    with pytest.raises(ValueError, match="quantization"):
        coordinator.add_engine("d9", ready("decode", KVLayout("weights", 2, 4, 2, 8, "float32", "auto", "int8")))
    with pytest.raises(ValueError, match="kv_hold_timeout"):
        coordinator.add_engine("d9", ready("decode", wait=90.0))
    coordinator.add_request(request())
    with pytest.raises(ValueError, match="in use"):
        coordinator.add_request(request())


def test_recommended_ratio_balances_the_busy_time_of_both_pools() -> None:
    # One prefill engine computes 1000 prompt tokens a busy second, one decode engine
    # samples 50 tokens a busy second; requests bring 400 prompt and 100 output tokens.
    prefill = EngineStats(num_computed_tokens=10_000, busy_seconds=10.0)
    decode = EngineStats(num_sampled_tokens=500, busy_seconds=10.0)
    # A prompt takes 0.4 s of a prefill engine, its output 2 s of a decode engine.
    assert recommended_prefill_decode_ratio([prefill], [decode], 400, 100) == pytest.approx(0.2)
    assert recommended_prefill_decode_ratio([prefill], [EngineStats()], 400, 100) == 0.0


def test_transfer_stats_count_loads_bytes_and_latency(coordinator: Coordinator, sent: list) -> None:
    to_loading(coordinator, sent)
    coordinator.on_outputs("d0", events(loaded=[KVLoadOutcome("r", 19, 19, None)]))
    stats = coordinator.stats
    assert (stats.num_complete, stats.num_incomplete, stats.latency.count) == (1, 0, 1)
    assert stats.bytes_transferred == 19 * LAYOUT.bytes_per_token
    assert stats.mean_remote_prompt_tokens == 19


def test_a_working_prefill_engine_keeps_its_decode_engines_waiting(sent: list) -> None:
    coordinator = Coordinator(lambda engine, message: sent.append((engine, message)))
    coordinator.add_engine("p0", ready("prefill"))
    coordinator.add_engine("d0", ready("decode", wait=0.003))  # renewed after a third of this
    coordinator.add_request(request())
    coordinator.on_outputs("d0", events(reserved=[KVReservation("r", 0, 19)]))
    time.sleep(0.002)
    coordinator.on_outputs("p0", events())  # a step of the prefill engine: it lives
    assert sent[-1] == ("d0", ExtendKVWait(["r"]))
    coordinator.on_outputs("p0", events(prefilled=[KVPrefilled("r", [3, 4, 5, 6, 7], 19)]))
    sent.clear()
    time.sleep(0.002)
    coordinator.on_outputs("p0", events())  # loading: the wait must stay shorter than the hold
    assert not any(isinstance(message, ExtendKVWait) for _, message in sent)
