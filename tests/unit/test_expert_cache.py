"""Expert offloading's decisions (engine/experts/), on CPU without weights: the LRU and LFU
caches replayed on small routing traces against hit counts worked out by hand, the
schedule of one step's loads and runs (never evicting an expert the step still needs,
loads before runs, waves, two stream buffers), prefetching, the copy-or-compute cost
model, and the options and counters."""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import pytest

from cadence.engine.experts import cost_model
from cadence.engine.experts.cache import (
    Action,
    ExpertCache,
    Load,
    Run,
    StreamBuffers,
    prefetch_actions,
    replay,
    step_actions,
)
from cadence.engine.experts.cost_model import CpuComputeCost, measure
from cadence.engine.experts.options import ExpertOffloadOptions
from cadence.engine.experts.policy import EvictionPolicy, LFUPolicy, LRUPolicy, make_policy
from cadence.engine.experts.stats import ExpertStats, ExpertStepStats

NUM_EXPERTS = 8

# Notation in the derivations: the policy's clock ticks once per routed expert, a step's
# experts in ascending order (replay records them sorted); "e@t" is expert e last used at
# tick t, "e:n@t" (LFU) also says it was routed n times. Slots are listed slot 0 first.

# A: 2 slots, one hot expert (0). LFU keeps it through a burst of others; LRU does not.
#  s1 [0]    both: miss, 0 -> free slot 0                                   [0, -]
#  s2 [0]    both: hit (0:2@2)
#  s3 [1]    both: miss, 1 -> free slot 1 (1:1@3)                            [0, 1]
#  s4 [2]    LRU: miss, victims {0@2, 1@3} evict 0                           [2, 1]
#            LFU: miss, victims {0:2@2, 1:1@3} evict 1                       [0, 2]
#  s5 [0]    LRU: miss, victims {2@4, 1@3} evict 1                           [2, 0]
#            LFU: hit (0:3@5)
#  s6 [1]    LRU: miss, victims {2@4, 0@5} evict 2                           [1, 0]
#            LFU: miss (1:2@6), victims {0:3@5, 2:1@4} evict 2               [0, 1]
#  s7 [0, 3] both: 0 hits and is pinned (0@7), 3 misses (3@8): only victim 1  LRU [3, 0], LFU [0, 3]
#  s8 [1]    LRU: miss (1@9), victims {3@8, 0@7} evict 0                     [3, 1]
#            LFU: miss (1:3@9), victims {0:4@7, 3:1@8} evict 3               [0, 1]
#  s9 [0]    LRU: miss (0@10), victims {3@8, 1@9} evict 3                    [0, 1]
#            LFU: hit
#  LRU: hits s2, s7 = 2, misses 8, loads 8.  LFU: hits s2, s5, s7, s9 = 4, misses 6, loads 6.
TRACE_A = [[0], [0], [1], [2], [0], [1], [3, 0], [1], [0]]

# B: 3 slots, a step routing 5 experts (waves), then the policies part ways.
#  s1 [0, 1]          both: 2 misses, 0 -> slot 0, 1 -> slot 1 (0@1, 1@2)    [0, 1, -]
#  s2 [0, 1, 2, 3, 4] both: 0, 1 hit and are pinned; 2 -> free slot 2; 3 finds every slot
#                     pinned, so 0 runs and gives up slot 0; 4 likewise waits for 1 (slot 1).
#                     2 hits, 3 misses, 3 loads (0:2@3 1:2@4 2:1@5 3:1@6 4:1@7) [3, 4, 2]
#  s3 [0, 5]          both: 2 misses (0:3@8, 5:1@9); 0 evicts 2 (oldest, fewest uses
#                     tied), then 5 evicts 3 (3@6 before 4@7)                  [5, 4, 0]
#  s4 [3, 4]          both: 4 hits, 3 misses (3:2@10, 4:2@11)
#                     LRU: victims {5@9, 0@8} evict 0                         [5, 4, 3]
#                     LFU: victims {5:1@9, 0:3@8} evict 5                     [3, 4, 0]
#  s5 [0]             LRU: miss, victims {5@9, 4@11, 3@10} evict 5            [0, 4, 3]
#                     LFU: hit
#  LRU: hits 2 + 1 = 3, misses 2+3+2+1+1 = 9, loads 9.  LFU: hits 4, misses 8, loads 8.
TRACE_B = [[0, 1], [4, 3, 2, 1, 0], [5, 0], [3, 4], [0]]

# C: 2 slots, a phase change: 0 was hot, then 1 and 2 alternate. LRU follows; LFU clings to 0.
#  s1..s3 [0]x3  both: miss then 2 hits (0:3@3); s1 routes 0 twice, counted once [0, -]
#  s4 [1]        both: miss, free slot 1 (1:1@4)                              [0, 1]
#  s5 [2]        LRU: miss, victims {0@3, 1@4} evict 0                        [2, 1]
#                LFU: miss, victims {0:3@3, 1:1@4} evict 1                    [0, 2]
#  s6..s9 [1], [2], [1], [2]
#                LRU: 4 hits
#                LFU: 4 misses: s6 1:2 evicts 2:1; s7 2:2 evicts 1:2; s8 1:3@8 evicts
#                2:2@7; s9 2:3@9 ties 0:3@3 and 1:3@8 on uses, evicts 0 (older)  [2, 1]
#  LRU: hits 6, misses 3, loads 3.  LFU: hits 2, misses 7, loads 7.
TRACE_C = [[0, 0], [0], [0], [1], [2], [1], [2], [1], [2]]


@pytest.mark.parametrize(
    ("trace", "slots", "policy", "hits", "misses", "final"),
    [
        (TRACE_A, 2, "lru", 2, 8, [0, 1]),
        (TRACE_A, 2, "lfu", 4, 6, [0, 1]),
        (TRACE_B, 3, "lru", 3, 9, [0, 4, 3]),
        (TRACE_B, 3, "lfu", 4, 8, [3, 4, 0]),
        (TRACE_C, 2, "lru", 6, 3, [2, 1]),
        (TRACE_C, 2, "lfu", 2, 7, [2, 1]),
    ],
)
def test_replay_matches_hand_counts(
    trace: list[list[int]], slots: int, policy: str, hits: int, misses: int, final: list[int]
) -> None:
    """replay() gives the hit, miss and load counts and final slots derived by hand above."""
    cache = ExpertCache(slots, make_policy(policy))
    counts = replay(trace, cache)
    assert (counts.hits, counts.misses, counts.loads) == (hits, misses, misses)
    assert cache.expert_in == final
    assert cache.slot_of == {e: s for s, e in enumerate(final)}


def execute(needed: list[int], actions: Iterable[Action], held: dict[int, int], cache: ExpertCache) -> list[Action]:
    """Carries out a step's actions as the runner does, on ``held`` (slot -> expert), checking each."""
    # where each routed expert that has not run yet is (or will be, once loaded) held
    where = {e: s for e in needed if (s := cache.resident(e)) is not None}
    waiting, done = set(needed), list[Action]()
    for action in actions:
        done.append(action)
        if isinstance(action, Load):
            assert action.expert in waiting and action.expert not in where, f"{action} is not a needed miss"
            assert action.slot not in where.values(), f"{action} overwrites an expert that has not run"
            held[action.slot] = action.expert
            where[action.expert] = action.slot
        else:
            assert where.pop(action.expert, None) == action.slot, f"{action} ran twice, or not where it was put"
            assert held.get(action.slot) == action.expert, f"{action}: the slot holds {held.get(action.slot)}"
            waiting.discard(action.expert)
    assert not waiting, f"{sorted(waiting)} never ran"
    return done


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_random_steps_never_evict_a_needed_expert(policy: str) -> None:
    """Under random routing, prefetches and streaming, every Run finds its expert in its slot, once."""
    rng = random.Random(20240611)
    for _ in range(12):
        num_slots = rng.randint(1, 6)
        threshold = rng.choice([num_slots, NUM_EXPERTS])  # the runner's default, or never stream
        cache, buffers = ExpertCache(num_slots, make_policy(policy)), StreamBuffers(num_slots)
        held: dict[int, int] = {}
        for _ in range(40):
            needed = sorted(rng.sample(range(NUM_EXPERTS), rng.randint(1, NUM_EXPERTS)))
            hits = [e for e in needed if cache.resident(e) is not None]
            cache.policy.record(needed)
            streaming = len(needed) > threshold
            claim = buffers.claim if streaming else cache.claim
            actions = execute(needed, step_actions(needed, cache.resident, claim), held, cache)
            loads = [a.expert for a in actions if isinstance(a, Load)]
            assert sorted(loads) == [e for e in needed if e not in hits]
            first_run = next(i for i, a in enumerate(actions) if isinstance(a, Run))
            if not streaming:  # every miss that can take an unpinned slot loads before anything runs
                assert first_run == min(len(loads), num_slots - len(hits))
            predicted = rng.sample(range(NUM_EXPERTS), rng.randint(0, 4))
            kept = {e: cache.resident(e) for e in predicted if cache.resident(e) is not None}
            for load in prefetch_actions(predicted, cache):
                held[load.slot] = load.expert
            assert {e: cache.resident(e) for e in kept} == kept
            assert all(held[s] == e for s, e in enumerate(cache.expert_in) if e is not None)


class ChoosesPinned(EvictionPolicy):
    """A broken policy: always names expert 0, whether or not it may go."""

    def victim(self, candidates: Iterable[int]) -> int:
        return 0


def test_policy_choosing_a_pinned_expert_is_refused() -> None:
    """ExpertCache.claim raises AssertionError (and keeps its slots) when the policy picks a pinned expert."""
    cache = ExpertCache(2, ChoosesPinned())
    assert [cache.claim(0, set()), cache.claim(1, set())] == [0, 1]
    with pytest.raises(AssertionError, match="pinned expert 0"):
        cache.claim(2, {0})
    with pytest.raises(AssertionError):
        list(step_actions([0, 2], cache.resident, cache.claim))
    assert cache.slot_of == {0: 0, 1: 1} and cache.expert_in == [0, 1]


def test_every_fitting_load_comes_before_the_first_run() -> None:
    """With enough slots, all misses load (evicting unneeded experts) before any expert runs."""
    cache = ExpertCache(4, LRUPolicy())
    for e in (0, 5):
        cache.claim(e, set())
    cache.policy.record([0, 5])
    # 0 hits in slot 0; 1 takes free slot 2, 2 free slot 3, 3 evicts 5 (unneeded) from slot 1.
    assert list(step_actions([0, 1, 2, 3], cache.resident, cache.claim)) == [
        Load(1, 2),
        Load(2, 3),
        Load(3, 1),
        Run(0, 0),
        Run(1, 2),
        Run(2, 3),
        Run(3, 1),
    ]


def test_more_misses_than_slots_runs_in_waves() -> None:
    """Step s2 of trace B: the oldest pinned expert runs and gives up its slot before each later load."""
    cache = ExpertCache(3, LRUPolicy())
    replay([[0, 1]], cache)
    cache.policy.record([0, 1, 2, 3, 4])
    assert list(step_actions([0, 1, 2, 3, 4], cache.resident, cache.claim)) == [
        Load(2, 2),
        Run(0, 0),
        Load(3, 0),
        Run(1, 1),
        Load(4, 1),
        Run(2, 2),
        Run(3, 0),
        Run(4, 1),
    ]


def test_stream_buffers_alternate_and_wait_for_runs() -> None:
    """Two stream buffers (slots 3, 4) take loads in turn; a buffer is reused only after its expert ran."""
    buffers = StreamBuffers(first_slot=3)
    cache = ExpertCache(3, LRUPolicy())
    cache.claim(7, set())  # a cached expert runs from its cache slot, not a buffer
    actions = list(step_actions([0, 1, 2, 3, 7], cache.resident, buffers.claim))
    assert actions == [
        Load(0, 3),
        Load(1, 4),
        Run(7, 0),
        Run(0, 3),
        Load(2, 3),
        Run(1, 4),
        Load(3, 4),
        Run(2, 3),
        Run(3, 4),
    ]
    assert buffers.claim(9, {2, 3}) is None  # both buffers hold experts that have not run
    assert buffers.claim(9, {3}) == 3 and buffers.holding == [9, 3]


def test_stream_buffer_holding_an_expert_that_already_ran_is_free() -> None:
    """A buffer whose expert ran in an earlier step is free, even if that expert is routed again now."""
    buffers = StreamBuffers(first_slot=0)
    list(step_actions([0, 1, 2], lambda e: None, buffers.claim))  # ends holding [2, 1], next buffer 1
    # 2 loads into buffer 1; buffer 0 still holds the copy of 2 that already ran: 3 may load there at once.
    buffers.begin_step()  # as the runner starts every streamed step
    assert list(step_actions([2, 3], lambda e: None, buffers.claim)) == [Load(2, 1), Load(3, 0), Run(2, 1), Run(3, 0)]


def test_prefetch_keeps_predicted_residents_and_stops_without_slots() -> None:
    """Prefetch evicts only unpredicted experts (even if a predicted one is LRU) and stops when none is left."""
    cache = ExpertCache(3, LRUPolicy())
    for e in (1, 0, 2):
        cache.claim(e, set())
        cache.policy.record([e])  # 1 is the least recently used
    assert list(prefetch_actions([1, 5, 6, 7], cache)) == [Load(5, 1), Load(6, 2)]
    assert cache.slot_of == {1: 0, 5: 1, 6: 2}
    assert list(prefetch_actions([5, 1, 6], cache)) == []
    fresh = ExpertCache(2, LFUPolicy())
    assert list(prefetch_actions([4, 3, 2], fresh)) == [Load(4, 0), Load(3, 1)]


def test_cpu_compute_choice_on_hand_numbers() -> None:
    """prefers_cpu and max_cpu_tokens on exact binary costs: ties go to the copy; edge cases."""
    cost = CpuComputeCost(copy_seconds=1.0, cpu_fixed_seconds=0.25, cpu_seconds_per_token=0.25)
    assert [cost.prefers_cpu(t) for t in range(5)] == [True, True, True, False, False]  # 3 tokens: 1.0, a tie
    assert cost.max_cpu_tokens() == 2
    assert CpuComputeCost(1.0, 0.0, 0.3).max_cpu_tokens() == 3  # 0.9 < 1.0 < 1.2
    assert CpuComputeCost(1.0, 0.5, 1.0).max_cpu_tokens() == 0  # only zero tokens would win
    never = CpuComputeCost(1.0, 1.0, 0.0)  # the fixed part alone costs a copy
    assert never.max_cpu_tokens() == 0 and not never.prefers_cpu(0) and not never.prefers_cpu(1)
    free = CpuComputeCost(1.0, 0.5, 0.0)
    assert free.max_cpu_tokens() == 1 << 30 and free.prefers_cpu(10**6)
    for copy in (0.5, 1.0, 3.0):
        for per in (0.0625, 0.125, 0.5):
            c = CpuComputeCost(copy, 0.125, per)
            n = c.max_cpu_tokens()
            assert c.prefers_cpu(n) and not c.prefers_cpu(n + 1), (copy, per, n)


def test_measure_with_a_fake_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """measure() fits copy, fixed and per-token costs from timed calls, keeping each call's fastest run."""
    now = [0.0]
    monkeypatch.setattr(cost_model.time, "perf_counter", lambda: now[0])
    copies = iter([5.0, 0.75, 0.5, 0.625])  # a slow warm-up, then the fastest of three: 0.5
    cpu_calls: list[int] = []

    def copy_one() -> None:
        now[0] += next(copies)

    def run_cpu(tokens: int) -> None:
        cpu_calls.append(tokens)
        now[0] += 0.125 + 0.0625 * tokens

    cost = measure(copy_one, run_cpu)
    assert cost == CpuComputeCost(0.5, 0.125, 0.0625)
    assert cpu_calls == [1] * 4 + [16] * 4  # one warm-up and three timed runs per token count
    noisy = measure(lambda: None, lambda t: now.__setitem__(0, now[0] + (0.5 if t == 1 else 0.25)))
    assert noisy == CpuComputeCost(0.0, 0.5, 0.0)  # more tokens timed faster: no per-token cost
    steep = measure(lambda: None, lambda t: now.__setitem__(0, now[0] + 0.125 * t - 0.0625))
    assert steep.cpu_seconds_per_token == 0.125 and steep.cpu_fixed_seconds == 0.0  # a negative fit clamps


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"mode": "ram"}, "expert_offload must be one of none, host, disk"),
        ({"cache_size": 0}, "expert_cache_size must be at least 1, not 0"),
        ({"cache_size": -2}, "expert_cache_size must be at least 1"),
        ({"policy": "fifo"}, "expert_cache_policy must be one of lfu, lru"),
        ({"stream_threshold": -1}, "expert_stream_threshold must be 0 or more"),
    ],
)
def test_options_reject_bad_values(kwargs: dict[str, Any], message: str) -> None:
    """ExpertOffloadOptions refuses a bad mode, cache size, policy or stream threshold."""
    with pytest.raises(ValueError, match=message):
        ExpertOffloadOptions(**kwargs)


def test_options_defaults_and_slots() -> None:
    """slots_per_layer defaults to twice the experts per token, capped at the layer's experts."""
    assert not ExpertOffloadOptions().enabled and ExpertOffloadOptions(mode="disk", stream_threshold=0).enabled
    assert ExpertOffloadOptions().slots_per_layer(8, 2) == 4
    assert ExpertOffloadOptions().slots_per_layer(8, 6) == 8
    assert ExpertOffloadOptions("disk", cache_size=3).slots_per_layer(8, 2) == 3
    assert ExpertOffloadOptions("disk", cache_size=20).slots_per_layer(8, 2) == 8
    # Never streaming on CPU, the slot count on CUDA; a chosen threshold everywhere.
    assert ExpertOffloadOptions("disk").stream_threshold_for("cpu", 8, 4) == 8
    assert ExpertOffloadOptions("host").stream_threshold_for("cuda", 8, 4) == 4
    assert ExpertOffloadOptions("host", stream_threshold=2).stream_threshold_for("cpu", 8, 4) == 2
    with pytest.raises(ValueError, match="need expert_offload"):
        ExpertOffloadOptions(cache_size=3)
    assert isinstance(make_policy("lfu"), LFUPolicy)
    with pytest.raises(ValueError, match="policy must be one of"):
        make_policy("mru")


def test_stats_take_step_and_rates() -> None:
    """take_step hands out what changed since the last call; the rates divide as named (0 when empty)."""
    stats = ExpertStats()
    assert stats.take_step() == ExpertStepStats()
    assert (stats.hit_rate, stats.prefetch_precision, stats.prefetch_recall) == (0.0, 0.0, 0.0)
    stats.hits, stats.misses, stats.load_bytes, stats.stall_seconds = 3, 1, 100, 0.5
    assert stats.take_step() == ExpertStepStats(hits=3, misses=1, load_bytes=100, stall_seconds=0.5)
    stats.hits += 2
    stats.prefetch_predicted, stats.prefetch_correct, stats.prefetch_routed = 4, 3, 6
    assert stats.take_step() == ExpertStepStats(hits=2, prefetch_predicted=4, prefetch_correct=3, prefetch_routed=6)
    assert stats.take_step() == ExpertStepStats()
    assert stats.hits == 5 and stats.hit_rate == 5 / 6
    assert stats.prefetch_precision == 0.75 and stats.prefetch_recall == 0.5
