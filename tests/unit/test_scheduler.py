"""Scheduler and KV-cache invariants, with a fake model that writes token ids as "KV".

The fake cache stores, per slot, the token id whose KV it holds. After every step each
scheduled request must read back exactly its own tokens through its block table: that
catches a shared block written by the wrong request, a stale prefix hit, or a copy that
did not happen. The fake model knows the requests only from the pickled
`SchedulerOutput`s, as a runner in another process would, and checks its copy of each
against the scheduler's every step.
"""

from __future__ import annotations

import pickle
import random
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cadence.scheduler.output import CachedRequestData, NewRequestData
from cadence.scheduler.request import Request, RequestStatus, StopConditions
from cadence.scheduler.scheduler import CacheConfig, Scheduler, SchedulerConfig, SchedulerOutput

EOS = 0


@dataclass
class HeldRequest:
    """The fake model's copy of a request, built from step deltas alone."""

    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class FakeModel:
    """Keeps a slot -> token table and checks every request's view of it."""

    def __init__(self, scheduler: Scheduler, rng: random.Random) -> None:
        self.scheduler = scheduler
        self.block_size = scheduler.kv_cache.block_size
        num_blocks = scheduler.kv_cache.pool.num_blocks
        self.slots: list[list[int | None]] = [[None] * self.block_size for _ in range(num_blocks)]
        self.rng = rng
        self.held: dict[str, HeldRequest] = {}

    def apply(self, output: SchedulerOutput) -> None:
        """Update the held copies from a step's changes only."""
        for request_id in output.finished_request_ids + output.preempted_request_ids:
            self.held.pop(request_id, None)
        for new in output.new_requests:
            assert new.request_id not in self.held, f"{new.request_id} sent as new twice"
            self.held[new.request_id] = HeldRequest(new.token_ids, new.block_ids, new.num_computed_tokens)
        for cached in output.cached_requests:
            held = self.held[cached.request_id]
            held.token_ids += cached.new_token_ids
            held.block_ids += cached.new_block_ids
            for index, block_id in cached.replaced_blocks:
                held.block_ids[index] = block_id
            held.num_computed_tokens = cached.num_computed_tokens
        # The model holds exactly the running requests. Those scheduled now are exactly as
        # the scheduler has them; one the budget left out may lack its newest token.
        assert set(self.held) == {r.request_id for r in self.scheduler.running}
        for request in self.scheduler.running:
            held = self.held[request.request_id]
            assert held.block_ids == request.block_ids, f"{request.request_id}: stale block table"
            if request.request_id in output.num_scheduled_tokens:
                assert held.token_ids == request.token_ids, f"{request.request_id}: stale tokens"
                assert held.num_computed_tokens == request.num_computed_tokens
            else:
                assert held.token_ids == request.token_ids[: len(held.token_ids)]

    def execute(self, output: SchedulerOutput, vocab: int = 50) -> dict[str, int]:
        self.apply(pickle.loads(pickle.dumps(output)))
        for src, dst in output.block_copies:
            self.slots[dst] = list(self.slots[src])
        for request_id, num_new in output.num_scheduled_tokens.items():
            held = self.held[request_id]
            for pos in range(held.num_computed_tokens, held.num_computed_tokens + num_new):
                block = held.block_ids[pos // self.block_size]
                self.slots[block][pos % self.block_size] = held.token_ids[pos]
        sampled = {}
        for request_id, num_new in output.num_scheduled_tokens.items():
            held = self.held[request_id]
            end = held.num_computed_tokens + num_new
            seen = [self.slots[held.block_ids[p // self.block_size]][p % self.block_size] for p in range(end)]
            assert seen == held.token_ids[:end], f"{request_id} reads wrong KV"
            if end == len(held.token_ids):
                sampled[request_id] = self.rng.randrange(vocab)
        return sampled


def make_request(rid: str, prompt: list[int], seq: int, max_tokens: int = 8, priority: int = 0, **kw: Any) -> Request:
    return Request(
        request_id=rid,
        prompt_token_ids=prompt,
        stop=StopConditions(max_tokens=max_tokens, stop_token_ids=frozenset({EOS})),
        arrival_seq=seq,
        priority=priority,
        **kw,
    )


def run_to_completion(scheduler: Scheduler, model: FakeModel, max_steps: int = 20000) -> dict[str, Request]:
    finished: dict[str, Request] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return finished
        output = scheduler.schedule()
        scheduler.check_integrity()
        assert output.num_batched_tokens <= scheduler.config.max_num_batched_tokens
        for item in scheduler.update(output, model.execute(output)):
            finished[item.request.request_id] = item.request
        scheduler.check_integrity()
    raise AssertionError("requests did not finish")


def test_chunked_prefill_respects_budget_and_finishes() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=8, max_model_len=256), CacheConfig(64, 4))
    model = FakeModel(scheduler, random.Random(0))
    scheduler.add_request(make_request("a", list(range(1, 30)), 0, max_tokens=5))
    scheduler.add_request(make_request("b", list(range(1, 4)), 1, max_tokens=5))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens == {"a": 8}
    assert model.execute(first) == {}  # a chunk short of the prompt's end samples nothing
    scheduler.update(first, {})
    finished = run_to_completion(scheduler, model)
    assert set(finished) == {"a", "b"}
    assert scheduler.kv_cache.usage == 0.0


def test_long_prefill_threshold_caps_each_prompts_chunk() -> None:
    """A prompt takes at most the threshold per step, so the budget's rest goes to the
    others: the running stream keeps its token every step, and a second prompt starts."""
    config = SchedulerConfig(max_num_batched_tokens=16, max_model_len=256, long_prefill_token_threshold=5)
    scheduler = Scheduler(config, CacheConfig(64, 4))
    model = FakeModel(scheduler, random.Random(1))
    scheduler.add_request(make_request("stream", [1, 2, 3], 0, max_tokens=20))
    first = scheduler.schedule()
    scheduler.update(first, model.execute(first))
    scheduler.add_request(make_request("long", list(range(1, 23)), 1, max_tokens=3))
    scheduler.add_request(make_request("other", list(range(40, 52)), 2, max_tokens=3))
    steps = []
    for _ in range(3):
        output = scheduler.schedule()
        steps.append(output.num_scheduled_tokens)
        scheduler.update(output, model.execute(output))
    assert steps == [{"stream": 1, "long": 5, "other": 5}] * 2 + [{"stream": 1, "long": 5, "other": 2}]
    finished = run_to_completion(scheduler, model)
    assert set(finished) == {"stream", "long", "other"}
    assert scheduler.kv_cache.usage == 0.0


def test_prefix_cache_hit_reuses_blocks_and_leaves_one_token() -> None:
    scheduler = Scheduler(SchedulerConfig(max_model_len=256), CacheConfig(64, 4))
    model = FakeModel(scheduler, random.Random(0))
    prompt = list(range(1, 17))  # exactly four blocks
    scheduler.add_request(make_request("a", prompt, 0, max_tokens=1))
    run_to_completion(scheduler, model)
    scheduler.add_request(make_request("b", prompt, 1, max_tokens=1))
    output = scheduler.schedule()
    # Three blocks hit; the fourth holds the last prompt token, which must be recomputed.
    (new,) = output.new_requests
    assert new.num_computed_tokens == 12 and len(new.block_ids) == 4
    assert output.num_scheduled_tokens == {"b": 4}
    scheduler.update(output, model.execute(output))
    scheduler.check_integrity()


def test_prefix_hit_is_confirmed_on_tokens_not_digest() -> None:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(16, 4))
    pool = scheduler.kv_cache.pool
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], 0, max_tokens=1))
    run_to_completion(scheduler, FakeModel(scheduler, random.Random(0)))
    (block_id,) = pool.cached_blocks.values()
    # Forge a colliding digest entry for other tokens: the lookup must refuse it.
    other = make_request("b", [9, 9, 9, 9, 9], 1)
    from cadence.scheduler.block_pool import BlockKey

    pool.cached_blocks[BlockKey(None, (9, 9, 9, 9)).digest] = block_id
    assert scheduler.kv_cache.find_cached_prefix(other) == []


@pytest.mark.parametrize("keys_mark_prompt", [False, True])
def test_blocks_holding_generated_tokens_serve_as_prompt_only_where_kv_ignores_the_prompt_end(
    keys_mark_prompt: bool,
) -> None:
    """An engine that runs prompt tokens' rows on kernels of their own computes a token's K/V
    differently as a prompt token than as a generated one: a later prompt holding an
    earlier request's output must not read that request's blocks then, yet the request
    itself (back after a preemption) still must."""
    config = CacheConfig(64, 4, keys_mark_prompt=keys_mark_prompt)
    scheduler = Scheduler(SchedulerConfig(max_model_len=256), config)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5, 6], 0, max_tokens=8))
    model = FakeModel(scheduler, random.Random(0))
    done = run_to_completion(scheduler, model)["a"]
    assert len(done.token_ids) == 14  # blocks 0-2 computed and cached; block 1 from position 6 on is output
    cache = scheduler.kv_cache
    follow_up = make_request("b", list(done.token_ids), 1, max_tokens=1)  # a's text, all of it prompt
    assert len(cache.find_cached_prefix(follow_up)) == (1 if keys_mark_prompt else 3)
    again = make_request("a-again", done.prompt_token_ids, 2, max_tokens=8)
    for token in done.output_token_ids:
        again.append_output_token(token)
    assert len(cache.find_cached_prefix(again)) == 3  # the same prompt end: every block
    # A prompt that ends where a block does leaves that block unmarked: any prompt sharing
    # its tokens finds it.
    scheduler.add_request(make_request("c", [1, 2, 3, 4, 5, 6, 7, 8], 3, max_tokens=4))
    run_to_completion(scheduler, model)
    assert len(cache.find_cached_prefix(make_request("d", [1, 2, 3, 4, 5, 6, 7, 8, 9], 4))) == 2


def test_preemption_recomputes_and_never_crashes() -> None:
    # 6 blocks of 4 tokens cannot hold three 10-token prompts growing to 18 tokens.
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(6, 4, enable_prefix_caching=False))
    model = FakeModel(scheduler, random.Random(1))
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [5 + i] * 10, i, max_tokens=8))
    finished = run_to_completion(scheduler, model)
    assert len(finished) == 3
    assert sum(r.num_preemptions for r in finished.values()) > 0


def test_a_preempted_request_comes_back_whole_with_its_outputs() -> None:
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(6, 4, enable_prefix_caching=False))
    model = FakeModel(scheduler, random.Random(1))
    for i in range(3):
        scheduler.add_request(make_request(f"r{i}", [5 + i] * 10, i, max_tokens=8))
    preempted: set[str] = set()
    resumed: list[NewRequestData] = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        preempted.update(output.preempted_request_ids)
        resumed += [new for new in output.new_requests if new.request_id in preempted]
        assert all(
            isinstance(c, CachedRequestData) and c.request_id not in output.preempted_request_ids
            for c in output.cached_requests
        )
        scheduler.update(output, model.execute(output))
        scheduler.check_integrity()
    assert resumed and all(len(new.token_ids) > new.num_prompt_tokens == 10 for new in resumed)


def test_priority_orders_admission_and_preempts_lowest() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=1), CacheConfig(32, 4))
    scheduler.add_request(make_request("low", [1, 2], 0, priority=5))
    scheduler.add_request(make_request("high", [3, 4], 1, priority=0))
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["high"]


def test_fork_shares_prompt_blocks_with_copy_on_write() -> None:
    scheduler = Scheduler(SchedulerConfig(), CacheConfig(32, 4, enable_prefix_caching=False))
    model = FakeModel(scheduler, random.Random(2))
    prompt = list(range(1, 11))  # 10 tokens: the third block is partial and shared
    scheduler.add_request(make_request("p", prompt, 0, max_tokens=4))
    for i in (1, 2):
        scheduler.add_request(make_request(f"c{i}", prompt, i, max_tokens=4, fork_parent_id="p"))
    output = scheduler.schedule()
    assert list(output.num_scheduled_tokens) == ["p"]
    scheduler.update(output, model.execute(output))
    scheduler.check_integrity()
    pool = scheduler.kv_cache.pool
    parent = scheduler.requests["p"]
    assert all(pool.ref_counts[b] == 3 for b in parent.block_ids)
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"p": 1, "c1": 1, "c2": 1}
    assert len(output.block_copies) == 2  # two of the three writers of the last block copy it
    # The parent's copy replaces its block 2 in place; the children arrive whole.
    (cached,) = output.cached_requests
    assert cached.replaced_blocks == [(2, parent.block_ids[2])] and cached.new_block_ids == []
    assert [new.request_id for new in output.new_requests] == ["c1", "c2"]
    scheduler.update(output, model.execute(output))
    scheduler.check_integrity()
    run_to_completion(scheduler, model)
    assert pool.num_free_blocks == 32


def test_abort_frees_blocks_everywhere() -> None:
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=4), CacheConfig(32, 4))
    model = FakeModel(scheduler, random.Random(3))
    scheduler.add_request(make_request("a", list(range(1, 20)), 0))
    scheduler.add_request(make_request("b", list(range(1, 20)), 1, fork_parent_id="a"))
    scheduler.add_request(make_request("c", [3, 3], 2))
    output = scheduler.schedule()
    scheduler.update(output, model.execute(output))
    scheduler.abort_requests(["a", "c", "unknown"])
    scheduler.check_integrity()
    assert scheduler.requests.keys() == {"b"}  # the child now computes its own prompt
    finished = run_to_completion(scheduler, model)
    assert finished["b"].status in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_STOPPED)
    assert scheduler.kv_cache.usage == 0.0


def test_min_tokens_defers_stop_and_max_model_len_caps() -> None:
    request = make_request("a", [1, 2], 0, max_tokens=100)
    request.stop = StopConditions(max_tokens=100, min_tokens=2, stop_token_ids=frozenset({EOS}))
    request.append_output_token(EOS)
    assert request.check_stop(max_model_len=100) is None
    request.append_output_token(EOS)
    assert request.check_stop(max_model_len=100) == RequestStatus.FINISHED_STOPPED
    long = make_request("b", [1, 2, 3], 1, max_tokens=100)
    long.append_output_token(7)
    assert long.check_stop(max_model_len=4) == RequestStatus.FINISHED_LENGTH


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    num_blocks=st.integers(6, 40),
    block_size=st.sampled_from([1, 2, 4, 8]),
    budget=st.integers(4, 64),
    max_num_seqs=st.integers(1, 8),
    prefix_caching=st.booleans(),
)
def test_random_workloads_keep_invariants(
    seed: int, num_blocks: int, block_size: int, budget: int, max_num_seqs: int, prefix_caching: bool
) -> None:
    rng = random.Random(seed)
    max_model_len = 48
    # Every request must fit alone, or it could never run; exactly that is the tightest case.
    num_blocks = max(num_blocks, -(-max_model_len // block_size))
    scheduler = Scheduler(
        SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_model_len),
        CacheConfig(num_blocks, block_size, prefix_caching),
    )
    model = FakeModel(scheduler, rng)
    shared_prefix = [rng.randrange(1, 50) for _ in range(12)]
    next_id, live = 0, []
    for _ in range(300):
        action = rng.random()
        if action < 0.25 and next_id < 40:
            prompt = shared_prefix[: rng.randrange(0, 12)] + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 20))]
            rid = f"r{next_id}"
            scheduler.add_request(
                make_request(rid, prompt, next_id, max_tokens=rng.randrange(1, 20), priority=rng.randrange(3))
            )
            live.append(rid)
            if rng.random() < 0.3:  # an n>1 sibling
                scheduler.add_request(make_request(rid + "-fork", prompt, next_id, max_tokens=5, fork_parent_id=rid))
            next_id += 1
        elif action < 0.3 and live:
            scheduler.abort_requests([live.pop(rng.randrange(len(live)))])
        output = scheduler.schedule()
        scheduler.check_integrity()
        assert output.num_batched_tokens <= budget
        assert len(output.num_scheduled_tokens) <= max_num_seqs
        scheduler.update(output, model.execute(output))
        scheduler.check_integrity()
    run_to_completion(scheduler, model)
    assert scheduler.kv_cache.pool.num_free_blocks == num_blocks


def test_waiting_children_cannot_pin_the_cache() -> None:
    # The parent fills all four blocks and finishes; the two children share them, and the
    # first one's copy-on-write block can only come from its sibling's references.
    scheduler = Scheduler(SchedulerConfig(max_model_len=16), CacheConfig(4, 4, enable_prefix_caching=False))
    model = FakeModel(scheduler, random.Random(4))
    prompt = list(range(3, 18))  # 15 tokens: the last block is partial
    scheduler.add_request(make_request("p", prompt, 0, max_tokens=1))
    for i in (1, 2):
        scheduler.add_request(make_request(f"c{i}", prompt, i, max_tokens=1, fork_parent_id="p"))
    finished = run_to_completion(scheduler, model, max_steps=50)
    assert set(finished) == {"p", "c1", "c2"}


def test_higher_priority_arrival_does_not_strand_forked_children() -> None:
    scheduler = Scheduler(SchedulerConfig(max_model_len=16), CacheConfig(4, 4, enable_prefix_caching=False))
    model = FakeModel(scheduler, random.Random(5))
    prompt = list(range(3, 11))  # two full blocks
    scheduler.add_request(make_request("a", prompt, 0, max_tokens=1, priority=1))
    scheduler.add_request(make_request("a#1", prompt, 1, max_tokens=1, priority=1, fork_parent_id="a"))
    output = scheduler.schedule()
    (done,) = scheduler.update(output, model.execute(output))  # a finishes; a#1 waits holding blocks
    assert done.request.request_id == "a" and scheduler.requests["a#1"].block_ids
    scheduler.add_request(make_request("x", list(range(20, 34)), 2, max_tokens=1, priority=0))
    finished = run_to_completion(scheduler, model, max_steps=50)
    assert set(finished) == {"a#1", "x"}


def test_a_complete_grammar_stops_a_request_before_min_and_at_max_tokens() -> None:
    """`complete` (the engine's matchers say the output's grammar is done) ends a request
    with its sampled token as stopped, whatever min_tokens asks, and wins over a length
    reached with the same token."""
    scheduler = Scheduler(SchedulerConfig(max_model_len=64), CacheConfig(16, 4))
    early = make_request("early", [1, 2, 3], 0, max_tokens=8)
    early.stop = StopConditions(max_tokens=8, min_tokens=6)
    last = make_request("last", [4, 5], 1, max_tokens=1)
    plain = make_request("plain", [6, 7], 2, max_tokens=8)
    for request in (early, last, plain):
        scheduler.add_request(request)
    output = scheduler.schedule()
    finished = scheduler.update(output, {"early": 9, "last": 9, "plain": 9}, complete={"early", "last"})
    assert {f.request.request_id: f.status for f in finished} == {
        "early": RequestStatus.FINISHED_STOPPED,
        "last": RequestStatus.FINISHED_STOPPED,
    }
    assert early.output_token_ids == [9] and early.stop_token_id is None
    assert plain.status == RequestStatus.RUNNING
