"""The scheduler half of the KV connector (engine/kv_connector/scheduler_side.py), with
fake models on both sides.

A prefill scheduler computes prompts for a decode scheduler; the decode side's fake model
copies "KV" (token ids per slot, see test_scheduler.py) out of the prefill side's slots.
Every step each scheduled request must read exactly its own tokens, so a load into the
wrong blocks, from blocks the prefill side reused, or a partial load taken as whole fails
the test. Faults are injected at every state, and both pools must end idle.
"""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.engine.kv_connector.scheduler_side import SchedulerSideConnector
from cadence.scheduler.remote_kv import KVLoadResult, RemoteKV
from cadence.scheduler.request import RequestStatus
from cadence.scheduler.scheduler import CacheConfig, Scheduler, SchedulerConfig, SchedulerOutput
from tests.unit.test_scheduler import FakeModel, make_request


class LoadingModel(FakeModel):
    """A fake model that also runs the step's KV loads: slot copies from another model.

    `fail_after` maps a request id to how many blocks of its load arrive before the
    transfer breaks; `in_flight` keeps loads unfinished until `complete` is called.
    """

    def __init__(self, scheduler: Scheduler, rng: random.Random, hold_loads: bool = False) -> None:
        super().__init__(scheduler, rng)
        self.fail_after: dict[str, int] = {}
        self.hold_loads = hold_loads
        self.in_flight: dict[str, tuple[FakeModel, list[int], list[int]]] = {}
        self.results: list[KVLoadResult] = []

    def execute(self, output: SchedulerOutput, vocab: int = 50) -> dict[str, int]:
        for load in output.kv_loads:
            self.in_flight[load.request_id] = (load.source, load.remote_block_ids, load.local_block_ids)
        for request_id in output.kv_cancels:
            if self.in_flight.pop(request_id, None) is not None:
                self.results.append(KVLoadResult(request_id, 0, "cancelled"))
        if not self.hold_loads:
            self.complete()
        return super().execute(output, vocab)

    def complete(self) -> None:
        for request_id, (source, remote, local) in self.in_flight.items():
            count = min(self.fail_after.get(request_id, len(remote)), len(remote))
            for src, dst in zip(remote[:count], local[:count]):
                self.slots[dst] = list(source.slots[src])
            error = None if count == len(remote) else "the transfer broke"
            self.results.append(KVLoadResult(request_id, count, error))
        self.in_flight.clear()

    def take_results(self) -> list[KVLoadResult]:
        results, self.results = self.results, []
        return results


def step(scheduler: Scheduler, model: FakeModel) -> list[str]:
    """One step; the ids of requests that finished in it."""
    output = scheduler.schedule()
    scheduler.check_integrity()
    finished = [f.request.request_id for f in scheduler.update(output, model.execute(output))]
    if isinstance(model, LoadingModel):
        kv(scheduler).finish_kv_loads(model.take_results())
    scheduler.check_integrity()
    return finished


def with_connector(config: SchedulerConfig, cache: CacheConfig) -> Scheduler:
    return Scheduler(config, cache, SchedulerSideConnector(wait_timeout=30.0, hold_timeout=60.0))


def kv(scheduler: Scheduler) -> SchedulerSideConnector:
    """The scheduler's connector, which takes the router's messages."""
    assert isinstance(scheduler.connector, SchedulerSideConnector)
    return scheduler.connector


def pair(block_size: int = 4, num_blocks: int = 64, budget: int = 16) -> tuple[Scheduler, Scheduler]:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_model_len=256)
    cache = CacheConfig(num_blocks, block_size)
    return with_connector(config, cache), with_connector(config, cache)


def test_the_scheduler_and_its_connector_half_import_no_torch() -> None:
    code = (
        "import sys, cadence.scheduler.scheduler, cadence.engine.kv_connector.scheduler_side; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_prompt_computed_on_prefill_side_is_decoded_on_decode_side() -> None:
    prefill, decode = pair()
    p_model, d_model = FakeModel(prefill, random.Random(0)), LoadingModel(decode, random.Random(1))
    prompt = list(range(1, 24))  # 23 tokens: 22 move, in six blocks of four
    decode.add_request(make_request("r", prompt, 0, max_tokens=4, remote_kv=RemoteKV.LOAD))
    step(decode, d_model)
    (reservation,) = kv(decode).take_kv_events().reserved
    assert (reservation.num_cached_tokens, reservation.num_tokens) == (0, 22)
    assert kv(decode).awaiting_kv["r"].status == RequestStatus.WAITING_FOR_KV
    assert not decode.has_work(), "a parked request takes no compute"

    prefill.add_request(make_request("r", prompt, 0, remote_kv=RemoteKV.SEND))
    while not kv(prefill).held_kv:
        step(prefill, p_model)
    (prefilled,) = kv(prefill).take_kv_events().prefilled
    assert prefilled.num_tokens == 22 and len(prefilled.block_ids) == 6
    assert kv(prefill).held_kv["r"].num_computed_tokens == 22, "the last prompt token is the decode side's"

    assert kv(decode).start_kv_load("r", p_model, prefilled.block_ids) is None
    step(decode, d_model)
    (outcome,) = kv(decode).take_kv_events().loaded
    assert outcome.complete and outcome.num_tokens_loaded == 22
    kv(prefill).release_sent_kv(["r"])
    assert prefill.kv_cache.pool.num_free_blocks == 64
    # The first step after the load computes one token and samples.
    output = decode.schedule()
    assert output.num_scheduled_tokens == {"r": 1}
    decode.update(output, d_model.execute(output))
    while decode.has_unfinished_requests():
        step(decode, d_model)
    assert decode.kv_cache.pool.num_free_blocks == 64


def test_prefix_hit_on_decode_side_loads_only_the_rest() -> None:
    prefill, decode = pair()
    p_model, d_model = FakeModel(prefill, random.Random(0)), LoadingModel(decode, random.Random(1))
    shared = list(range(1, 13))  # three blocks
    decode.add_request(make_request("warm", shared + [40], 0, max_tokens=1))
    while decode.has_unfinished_requests():
        step(decode, d_model)
    decode.add_request(make_request("r", shared + [41, 42, 43, 44, 45, 46], 1, remote_kv=RemoteKV.LOAD))
    step(decode, d_model)
    (reservation,) = kv(decode).take_kv_events().reserved
    assert (reservation.num_cached_tokens, reservation.num_tokens) == (12, 17)
    prefill.add_request(make_request("r", shared + [41, 42, 43, 44, 45, 46], 1, remote_kv=RemoteKV.SEND))
    while not kv(prefill).held_kv:
        step(prefill, p_model)
    blocks = kv(prefill).take_kv_events().prefilled[0].block_ids
    kv(decode).start_kv_load("r", p_model, blocks)
    output = decode.schedule()
    (load,) = output.kv_loads
    assert load.remote_block_ids == blocks[3:5], "only the blocks past the hit move"


def test_whole_prompt_cached_on_decode_side_runs_without_transfer() -> None:
    _, decode = pair()
    d_model = LoadingModel(decode, random.Random(1))
    prompt = list(range(1, 10))  # two full blocks and one token
    decode.add_request(make_request("warm", prompt, 0, max_tokens=1))
    while decode.has_unfinished_requests():
        step(decode, d_model)
    decode.add_request(make_request("r", prompt, 1, max_tokens=2, remote_kv=RemoteKV.LOAD))
    output = decode.schedule()
    (reservation,) = kv(decode).take_kv_events().reserved
    assert not reservation.needs_transfer
    assert output.num_scheduled_tokens == {"r": 1}


@pytest.mark.parametrize("fault", ["broken", "short_source", "cancel_before_load", "cancel_mid_load"])
def test_failed_transfers_recompute_the_rest_here(fault: str) -> None:
    prefill, decode = pair()
    p_model = FakeModel(prefill, random.Random(0))
    d_model = LoadingModel(decode, random.Random(1), hold_loads=fault == "cancel_mid_load")
    prompt = list(range(1, 30))
    decode.add_request(make_request("r", prompt, 0, max_tokens=3, remote_kv=RemoteKV.LOAD))
    prefill.add_request(make_request("r", prompt, 0, remote_kv=RemoteKV.SEND))
    step(decode, d_model)
    while not kv(prefill).held_kv:
        step(prefill, p_model)
    blocks = kv(prefill).take_kv_events().prefilled[0].block_ids
    if fault == "broken":
        d_model.fail_after["r"] = 2
        assert kv(decode).start_kv_load("r", p_model, blocks) is None
    elif fault == "short_source":
        assert "blocks of the prompt's" in str(kv(decode).start_kv_load("r", p_model, blocks[:3]))
    elif fault == "cancel_before_load":
        assert kv(decode).cancel_kv_wait("r", "the prefill engine died")
    else:
        kv(decode).start_kv_load("r", p_model, blocks)
        step(decode, d_model)
        assert kv(decode).cancel_kv_wait("r", "deadline")
    kv(prefill).release_sent_kv(["r"])
    while decode.has_unfinished_requests():
        step(decode, d_model)  # any wrong slot would fail a read here
    (outcome,) = kv(decode).take_kv_events().loaded
    assert not outcome.complete
    expected = {"broken": 8, "short_source": 0, "cancel_before_load": 0, "cancel_mid_load": 0}[fault]
    assert outcome.num_tokens_loaded == expected
    assert decode.kv_cache.pool.num_free_blocks == 64 and prefill.kv_cache.pool.num_free_blocks == 64


def test_prompts_the_router_keeps_here_share_one_chunk_a_step() -> None:
    """Placed on the decode engine with 8-token chunks, two prompts take 8 tokens a step
    between them (the first one first), beside a running stream that keeps its token
    every step; a plain request behind them is not held up. Every read is checked."""
    _, decode = pair()
    model = FakeModel(decode, random.Random(2))
    decode.add_request(make_request("stream", [1, 2, 3], 0, max_tokens=20))
    step(decode, model)
    for seq, rid in enumerate(("a", "b"), start=1):
        decode.add_request(make_request(rid, list(range(seq, seq + 20)), seq, max_tokens=2, remote_kv=RemoteKV.LOAD))
    step(decode, model)  # reserves both, and parks them waiting for KV
    assert kv(decode).cancel_kv_wait("a", "placed here", chunk_tokens=8)
    assert kv(decode).cancel_kv_wait("b", "placed here", chunk_tokens=8)
    decode.add_request(make_request("plain", [7, 8, 9], 3, max_tokens=2))
    steps = []
    for _ in range(6):
        output = decode.schedule()
        steps.append({rid: n for rid, n in output.num_scheduled_tokens.items() if rid != "stream"})
        assert output.num_scheduled_tokens.get("stream") == 1
        decode.update(output, model.execute(output))
    assert steps[0] == {"a": 8, "plain": 3}
    assert [s.get("a", 0) for s in steps] == [8, 8, 4, 1, 0, 0]  # 20 prompt tokens, its second token, done
    assert [s.get("b", 0) for s in steps] == [0, 0, 4, 8, 8, 1]
    while decode.has_unfinished_requests():
        step(decode, model)
    assert decode.kv_cache.pool.num_free_blocks == 64


def test_abort_mid_load_frees_blocks_only_after_the_runner_lets_go() -> None:
    prefill, decode = pair()
    p_model = FakeModel(prefill, random.Random(0))
    d_model = LoadingModel(decode, random.Random(1), hold_loads=True)
    prompt = list(range(1, 30))
    decode.add_request(make_request("r", prompt, 0, remote_kv=RemoteKV.LOAD))
    prefill.add_request(make_request("r", prompt, 0, remote_kv=RemoteKV.SEND))
    step(decode, d_model)
    while not kv(prefill).held_kv:
        step(prefill, p_model)
    kv(decode).start_kv_load("r", p_model, kv(prefill).take_kv_events().prefilled[0].block_ids)
    step(decode, d_model)
    held = 64 - decode.kv_cache.pool.num_free_blocks
    decode.abort_requests(["r"])
    decode.check_integrity()
    assert 64 - decode.kv_cache.pool.num_free_blocks == held, "blocks a transfer may write were freed"
    step(decode, d_model)  # the runner hears the cancel and reports
    assert decode.kv_cache.pool.num_free_blocks == 64
    prefill.abort_requests(["r"])
    assert prefill.kv_cache.pool.num_free_blocks == 64


def test_prefill_side_prompt_fully_cached_is_held_at_once() -> None:
    prefill, _ = pair()
    p_model = FakeModel(prefill, random.Random(0))
    prompt = list(range(1, 10))  # 8 tokens to send: two full blocks
    prefill.add_request(make_request("a", prompt, 0, remote_kv=RemoteKV.SEND))
    while not kv(prefill).held_kv:
        step(prefill, p_model)
    prefill.add_request(make_request("b", prompt, 1, remote_kv=RemoteKV.SEND))
    output = prefill.schedule()
    assert output.is_empty and "b" in kv(prefill).held_kv
    events = kv(prefill).take_kv_events().prefilled
    assert events[-1].block_ids == kv(prefill).held_kv["a"].block_ids[:2]
    kv(prefill).release_sent_kv(["a", "b"])
    prefill.check_integrity()
    assert prefill.kv_cache.pool.num_free_blocks == 64


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(16, 48), block_size=st.sampled_from([1, 2, 4, 8]))
def test_random_disaggregated_workloads_keep_both_pools_whole(seed: int, num_blocks: int, block_size: int) -> None:
    rng = random.Random(seed)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=rng.randrange(4, 40), max_model_len=48)
    num_blocks = max(num_blocks, -(-config.max_model_len // block_size))  # every request fits alone
    prefill = with_connector(config, CacheConfig(num_blocks, block_size))
    decode = with_connector(config, CacheConfig(num_blocks, block_size))
    p_model = FakeModel(prefill, rng)
    d_model = LoadingModel(decode, rng, hold_loads=rng.random() < 0.5)
    shared = [rng.randrange(1, 50) for _ in range(12)]
    sent: dict[str, list[int]] = {}  # prefilled id -> its blocks, until the load is started
    for index in range(200):
        if index < 120 and rng.random() < 0.2:
            rid = f"r{index}"
            prompt = shared[: rng.randrange(0, 12)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 24))]
            max_tokens = rng.randrange(1, 8)
            decode.add_request(make_request(rid, prompt, index, max_tokens=max_tokens, remote_kv=RemoteKV.LOAD))
            prefill.add_request(make_request(rid, prompt, index, remote_kv=RemoteKV.SEND))
        live = sorted(decode.requests)
        if live and rng.random() < 0.05:
            rid = rng.choice(live)
            decode.abort_requests([rid])
            prefill.abort_requests([rid])
        if live and rng.random() < 0.03:
            kv(decode).cancel_kv_wait(rng.choice(live), "deadline")
        step(prefill, p_model)
        for prefilled in kv(prefill).take_kv_events().prefilled:
            sent[prefilled.request_id] = prefilled.block_ids
        for rid in list(sent):
            if rid in kv(decode).awaiting_kv and rng.random() < 0.5:
                if rng.random() < 0.2:
                    d_model.fail_after[rid] = rng.randrange(3)
                kv(decode).start_kv_load(rid, p_model, sent.pop(rid))
        if d_model.hold_loads and rng.random() < 0.3:
            d_model.complete()
        step(decode, d_model)
        events = kv(decode).take_kv_events()
        done = [o.request_id for o in events.loaded] + [r.request_id for r in events.reserved if not r.needs_transfer]
        kv(prefill).release_sent_kv(done)
        for rid in list(kv(prefill).held_kv):
            reader = decode.requests.get(rid)
            if reader is None or reader.remote_kv is None:  # the reader is gone or stopped waiting
                kv(prefill).release_sent_kv([rid])
                sent.pop(rid, None)
    for rid in list(kv(decode).awaiting_kv):
        kv(decode).cancel_kv_wait(rid, "the test is ending")
    d_model.hold_loads = False
    for _ in range(2000):
        if not (decode.has_work() or prefill.has_work()):
            break
        step(prefill, p_model)
        step(decode, d_model)
    kv(prefill).release_sent_kv(list(kv(prefill).held_kv))
    assert not decode.requests and not prefill.requests
    assert decode.kv_cache.pool.num_free_blocks == num_blocks
    assert prefill.kv_cache.pool.num_free_blocks == num_blocks
