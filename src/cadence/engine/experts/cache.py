"""A layer's expert slots in fast memory, and the order in which one step loads and runs
its routed experts.

``ExpertCache`` maps experts to a fixed number of slots and asks its policy for victims,
never choosing an expert the step has pinned. ``step_actions`` turns one step's routed
experts into ``Load`` and ``Run`` actions: every miss that can get a slot is loaded
before anything runs (so copies overlap the computation of what is already resident);
when the misses outnumber the free slots, the oldest pinned expert runs, is unpinned and
gives up its slot, and the step goes on in waves. The same schedule streams a layer
through two buffers (``StreamBuffers``) when most of its experts are routed at once. The
device work behind each action is the runner's (``offloaded.py``); this file only
decides, so a routing trace can be replayed here without any weights.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from cadence.engine.experts.policy import EvictionPolicy


@dataclass(frozen=True)
class Load:
    """Copy ``expert``'s weights into ``slot``."""

    expert: int
    slot: int


@dataclass(frozen=True)
class Run:
    """Compute ``expert`` on its tokens from ``slot`` (after any load into it)."""

    expert: int
    slot: int


Action = Load | Run
# (expert, experts the step has pinned) -> a slot for it, or None when every slot is pinned.
Claim = Callable[[int, set[int]], int | None]


class ExpertCache:
    """``num_slots`` slots, each empty or holding one expert."""

    def __init__(self, num_slots: int, policy: EvictionPolicy) -> None:
        if num_slots < 1:
            raise ValueError("an expert cache needs at least one slot")
        self.num_slots = num_slots
        self.policy = policy
        self.expert_in: list[int | None] = [None] * num_slots
        self.slot_of: dict[int, int] = {}

    def resident(self, expert: int) -> int | None:
        return self.slot_of.get(expert)

    def claim(self, expert: int, pinned: set[int]) -> int | None:
        """A slot for ``expert`` (not resident): a free one, else the policy's victim among
        the unpinned residents; None when every resident is pinned. The slot is recorded as
        holding ``expert`` at once; its load is the caller's."""
        slot = next((s for s, held in enumerate(self.expert_in) if held is None), None)
        if slot is None:
            candidates = [e for e in self.slot_of if e not in pinned]
            if not candidates:
                return None
            victim = self.policy.victim(candidates)
            if victim in pinned:  # a policy bug would corrupt a running step: refuse loudly
                raise AssertionError(f"policy chose pinned expert {victim}")
            slot = self.slot_of.pop(victim)
        self.expert_in[slot] = expert
        self.slot_of[expert] = slot
        return slot

    def forget_slot(self, slot: int) -> None:
        """Mark ``slot`` empty (its load failed, so what it holds is unknown)."""
        if slot < self.num_slots and (held := self.expert_in[slot]) is not None:
            self.expert_in[slot] = None
            del self.slot_of[held]


class StreamBuffers:
    """Two (or more) buffers a streamed layer loads into in turn: slot ids follow the
    cache's (``first_slot`` on), and a buffer is free once its expert has run."""

    def __init__(self, first_slot: int, count: int = 2) -> None:
        self.first_slot = first_slot
        self.holding: list[int | None] = [None] * count
        self.next = 0

    def begin_step(self) -> None:
        """Forget the last step's experts: a buffer's contents are never looked up, so
        within a step a buffer is busy exactly while the miss loaded into it waits to run."""
        self.holding = [None] * len(self.holding)

    def claim(self, expert: int, pinned: set[int]) -> int | None:
        for i in range(len(self.holding)):
            b = (self.next + i) % len(self.holding)
            if self.holding[b] is None or self.holding[b] not in pinned:
                self.holding[b] = expert
                self.next = (b + 1) % len(self.holding)
                return self.first_slot + b
        return None


def step_actions(needed: Iterable[int], resident: Callable[[int], int | None], claim: Claim) -> Iterator[Action]:
    """One step's actions for the routed experts ``needed``. Resident ones run from their
    slots; each miss is loaded into a claimed slot. The caller executes each action before
    asking for the next, which is when a run's expert is unpinned."""
    pinned: set[int] = set()
    runs: deque[Run] = deque()
    misses: list[int] = []
    for expert in needed:
        slot = resident(expert)
        if slot is None:
            misses.append(expert)
        else:
            pinned.add(expert)
            runs.append(Run(expert, slot))
    for expert in misses:
        while (slot := claim(expert, pinned)) is None:
            if not runs:
                raise RuntimeError("no slot can take an expert: every slot is pinned and nothing is left to run")
            done = runs.popleft()
            yield done
            pinned.discard(done.expert)
        pinned.add(expert)
        yield Load(expert, slot)
        runs.append(Run(expert, slot))
    yield from runs


def prefetch_actions(predicted: Iterable[int], cache: ExpertCache) -> Iterator[Load]:
    """Loads that bring ``predicted`` experts (most likely first) into the cache, stopping
    when no slot is left that a prediction does not hold."""
    predicted = list(predicted)
    pinned = {e for e in predicted if cache.resident(e) is not None}
    for expert in predicted:
        if cache.resident(expert) is not None:
            continue
        slot = cache.claim(expert, pinned)
        if slot is None:
            return
        pinned.add(expert)
        yield Load(expert, slot)


@dataclass
class ReplayCounts:
    hits: int = 0
    misses: int = 0
    loads: int = 0


def replay(trace: Iterable[Iterable[int]], cache: ExpertCache) -> ReplayCounts:
    """Run a routing trace (each step's routed experts of one layer) through the cache's
    schedule without weights: how many routed experts were resident, and how many loads."""
    counts = ReplayCounts()
    for step in trace:
        needed = sorted(set(step))
        hits = sum(cache.resident(e) is not None for e in needed)
        counts.hits += hits
        counts.misses += len(needed) - hits
        cache.policy.record(needed)
        counts.loads += sum(isinstance(a, Load) for a in step_actions(needed, cache.resident, cache.claim))
    return counts
