"""Which resident expert an expert cache evicts: least recently used, or least frequently
used. A policy only ranks; the cache decides what may be evicted (never an expert the
step still needs)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable


class EvictionPolicy(ABC):
    """Sees every routed use of an expert, in order, and picks victims among candidates."""

    def __init__(self) -> None:
        self.clock = 0
        self.last_used: dict[int, int] = {}
        self.uses: dict[int, int] = {}

    def record(self, experts: Iterable[int]) -> None:
        """One step's routed experts (each once), in use order."""
        for expert in experts:
            self.clock += 1
            self.last_used[expert] = self.clock
            self.uses[expert] = self.uses.get(expert, 0) + 1

    @abstractmethod
    def victim(self, candidates: Iterable[int]) -> int:
        """The candidate to evict (candidates is not empty)."""


class LRUPolicy(EvictionPolicy):
    """Evicts the expert whose last use is oldest (ties: the lowest id)."""

    def victim(self, candidates: Iterable[int]) -> int:
        return min(candidates, key=lambda e: (self.last_used.get(e, 0), e))


class LFUPolicy(EvictionPolicy):
    """Evicts the expert routed the fewest times since the engine started, counting uses
    while it was not resident too, so an expert that is popular but was evicted once
    wins its slot back; ties go to the least recently used, then the lowest id."""

    def victim(self, candidates: Iterable[int]) -> int:
        return min(candidates, key=lambda e: (self.uses.get(e, 0), self.last_used.get(e, 0), e))


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "lfu": LFUPolicy}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"expert cache policy must be one of {sorted(POLICIES)}, not {name!r}") from None
