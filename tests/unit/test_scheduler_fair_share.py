"""Fair shares between client requests (scheduler/fair_share.py): a request's n sequences
share one request's part of the seats and of each step's token budget.

Every test counts scheduled tokens and steps, never time; the fake model checks every
read of the KV cache as in test_scheduler.py.
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.scheduler.fair_share import water_fill
from cadence.scheduler.scheduler import CacheConfig, Scheduler, SchedulerConfig, SchedulerOutput
from tests.unit.test_scheduler import FakeModel, make_request, run_to_completion


def add_client_request(
    scheduler: Scheduler, rid: str, prompt: list[int], n: int, seq: int, max_tokens: int, priority: int = 0
) -> list[str]:
    """A client request of n sequences, named and forked as EngineCore does it."""
    ids = [rid] if n == 1 else [f"{rid}#{i}" for i in range(n)]
    for index, sub_id in enumerate(ids):
        scheduler.add_request(
            make_request(
                sub_id,
                prompt,
                seq + index,
                max_tokens=max_tokens,
                priority=priority,
                fork_parent_id=ids[0] if index else None,
                client_request_id=rid,
            )
        )
    return ids


def step(scheduler: Scheduler, model: FakeModel) -> SchedulerOutput:
    """One step in which no sequence samples EOS, so each runs to its max_tokens."""
    output = scheduler.schedule()
    scheduler.check_integrity()
    scheduler.update(output, {rid: token or 1 for rid, token in model.execute(output).items()})
    scheduler.check_integrity()
    return output


def test_water_fill_is_max_min_fair() -> None:
    assert water_fill([1, 128], 16) == [1, 15]  # what the small one leaves passes on
    assert water_fill([10, 10, 10], 16) == [6, 5, 5]  # the remainder goes to the earliest
    assert water_fill([3, 100, 2], 1000) == [3, 100, 2]  # enough for everyone
    assert water_fill([5, 5], 0) == [0, 0]
    assert water_fill([], 7) == []


def test_one_sequence_is_scheduled_every_step_beside_a_request_of_64_filling_every_seat() -> None:
    """The n=64 request holds all 16 seats when the n=1 request arrives: one of its
    sequences gives a seat back at once, and the n=1 request then gets its token every
    step until it ends, while the other request keeps the other 15 seats busy."""
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    scheduler = Scheduler(config, CacheConfig(1024, 4))
    model = FakeModel(scheduler, random.Random(0))
    wide = add_client_request(scheduler, "wide", list(range(1, 21)), 64, 0, max_tokens=100)
    for _ in range(3):
        step(scheduler, model)
    assert len(scheduler.running) == 16 and all(r.client_request_id == "wide" for r in scheduler.running)
    add_client_request(scheduler, "lone", list(range(30, 40)), 1, 100, max_tokens=30)
    steps = 0
    while "lone" in scheduler.requests:
        output = step(scheduler, model)
        steps += 1
        assert "lone" in output.num_scheduled_tokens
        assert sum(rid in output.num_scheduled_tokens for rid in wide) == 15
    assert steps == 30  # its prompt and first token in one step, then one token a step
    finished = run_to_completion(scheduler, model)
    assert set(finished) == set(wide)
    assert scheduler.kv_cache.pool.num_free_blocks == 1024


def test_a_request_of_64_shares_a_small_budget_in_turns() -> None:
    """With 16 tokens a step, the n=1 request gets its token every step and the n=64
    request the other 15, its sequences taking turns: none waits more than five steps."""
    config = SchedulerConfig(max_num_seqs=128, max_num_batched_tokens=16, max_model_len=256)
    scheduler = Scheduler(config, CacheConfig(1024, 4))
    model = FakeModel(scheduler, random.Random(1))
    wide = add_client_request(scheduler, "wide", [5, 6, 7, 8], 64, 0, max_tokens=60)
    for _ in range(10):
        step(scheduler, model)
    add_client_request(scheduler, "lone", [9, 10, 11], 1, 100, max_tokens=40)
    last_turn = dict.fromkeys(wide, 0)
    for number in range(1, 40):
        output = step(scheduler, model)
        assert output.num_scheduled_tokens.get("lone") == (3 if number == 1 else 1)
        assert output.num_batched_tokens == 16
        for rid in wide:
            if rid in output.num_scheduled_tokens:
                last_turn[rid] = number
            assert number - last_turn[rid] < 5, f"{rid} waited since step {last_turn[rid]}"


def test_a_long_prompt_leaves_a_new_request_its_share_of_the_budget() -> None:
    """A 400-token prompt does not take every step's whole budget while a short request
    waits: the short one starts in the next step, and the long one gets the rest."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=512)
    scheduler = Scheduler(config, CacheConfig(256, 4))
    model = FakeModel(scheduler, random.Random(2))
    add_client_request(scheduler, "long", [7] * 400, 8, 0, max_tokens=4)
    assert step(scheduler, model).num_scheduled_tokens == {"long#0": 64}
    add_client_request(scheduler, "short", list(range(1, 11)), 1, 100, max_tokens=3)
    assert step(scheduler, model).num_scheduled_tokens == {"long#0": 54, "short": 10}
    assert step(scheduler, model).num_scheduled_tokens == {"long#0": 63, "short": 1}
    finished = run_to_completion(scheduler, model)
    assert "short" in finished and len(finished) == 9


def test_what_the_waiting_line_cannot_use_passes_on_in_the_same_step() -> None:
    """The waiting request asks for its whole prompt, but the prefix cache holds most of
    it: the running prompt gets what it leaves, so the step is still full."""
    config = SchedulerConfig(max_num_batched_tokens=32, max_model_len=512)
    scheduler = Scheduler(config, CacheConfig(256, 4))
    model = FakeModel(scheduler, random.Random(3))
    cached = list(range(1, 31))
    add_client_request(scheduler, "first", cached, 1, 0, max_tokens=1)
    run_to_completion(scheduler, model)
    add_client_request(scheduler, "long", [7] * 200, 1, 1, max_tokens=2)
    step(scheduler, model)
    add_client_request(scheduler, "again", cached, 1, 2, max_tokens=2)
    output = step(scheduler, model)
    assert output.num_scheduled_tokens == {"long": 30, "again": 2}  # 28 of its 30 tokens were cached


def test_block_pressure_preempts_the_widest_request_first() -> None:
    """When blocks run out, the sequences of the request holding the most seats go first,
    not the newest request of one sequence."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=64)
    scheduler = Scheduler(config, CacheConfig(40, 4, enable_prefix_caching=False))
    model = FakeModel(scheduler, random.Random(4))
    add_client_request(scheduler, "wide", [3] * 6, 6, 0, max_tokens=30)
    step(scheduler, model)
    add_client_request(scheduler, "lone", [4] * 6, 1, 10, max_tokens=30)
    preempted: list[str] = []
    while scheduler.has_unfinished_requests():
        preempted += step(scheduler, model).preempted_request_ids
    assert preempted and "lone" not in preempted


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(12, 60),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 64),
    max_num_seqs=st.integers(1, 12),
    prefix_caching=st.booleans(),
)
def test_random_client_requests_keep_invariants_and_each_gets_a_turn(
    seed: int, num_blocks: int, block_size: int, budget: int, max_num_seqs: int, prefix_caching: bool
) -> None:
    """Requests of 1 to 6 sequences, arriving and aborted at random: the invariants hold
    every step, everything finishes and frees its blocks, and in a step that preempted
    nothing and had a token for each, every running client request got one."""
    rng = random.Random(seed)
    max_model_len = 40
    num_blocks = max(num_blocks, -(-max_model_len // block_size))
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len),
        CacheConfig(num_blocks, block_size, prefix_caching),
    )
    model = FakeModel(scheduler, rng)
    next_seq, live = 0, []
    for _ in range(200):
        if rng.random() < 0.2 and next_seq < 200:
            rid, n = f"c{next_seq}", rng.choice([1, 1, 2, 6])
            prompt = [rng.randrange(1, 30) for _ in range(rng.randrange(1, 16))]
            add_client_request(scheduler, rid, prompt, n, next_seq, rng.randrange(1, 16), rng.randrange(2))
            live.append(rid)
            next_seq += n
        elif rng.random() < 0.05 and live:
            doomed = live.pop(rng.randrange(len(live)))
            scheduler.abort_requests([rid for rid, r in scheduler.requests.items() if r.client_request_id == doomed])
        clients_before = {r.client_request_id for r in scheduler.running}
        output = scheduler.schedule()
        scheduler.check_integrity()
        assert output.num_batched_tokens <= budget
        if not output.preempted_request_ids and budget > len(clients_before):
            scheduled = {scheduler.requests[rid].client_request_id for rid in output.num_scheduled_tokens}
            assert {r.client_request_id for r in scheduler.running} & clients_before <= scheduled
        scheduler.update(output, model.execute(output))
        scheduler.check_integrity()
    run_to_completion(scheduler, model)
    assert scheduler.kv_cache.pool.num_free_blocks == num_blocks
