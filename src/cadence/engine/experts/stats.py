"""Running totals of what expert offloading did, shared by a model's MoE layers; the
engine reports each step's share (``ExpertStepStats``) to the front end's /metrics."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass
class ExpertStepStats:
    """Counts over one step (or, in ``ExpertStats``, since the engine started)."""

    hits: int = 0  # routed experts already in a slot
    misses: int = 0  # routed experts loaded (or, with CPU compute, run from host memory)
    load_bytes: int = 0  # bytes copied into slots, prefetches included
    stall_seconds: float = 0.0  # compute waiting for a load
    prefetch_loads: int = 0  # experts loaded ahead of their layer
    prefetch_predicted: int = 0  # experts predicted for a layer before it routed
    prefetch_correct: int = 0  # of those, routed
    prefetch_routed: int = 0  # experts routed in layers that had a prediction
    streamed_layers: int = 0  # layer steps that streamed through the buffers
    cached_layers: int = 0  # layer steps that went through the cache
    waves: int = 0  # times a layer ran an expert to free a slot before loading the next
    cpu_computed: int = 0  # cold experts run on the CPU instead of loaded (CUDA)

    def minus(self, earlier: ExpertStepStats) -> ExpertStepStats:
        return ExpertStepStats(
            **{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)}
        )

    def plus(self, other: ExpertStepStats) -> ExpertStepStats:
        return ExpertStepStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in dataclasses.fields(self)}
        )

    @property
    def hit_rate(self) -> float:
        routed = self.hits + self.misses
        return self.hits / routed if routed else 0.0

    @property
    def prefetch_precision(self) -> float:
        return self.prefetch_correct / self.prefetch_predicted if self.prefetch_predicted else 0.0

    @property
    def prefetch_recall(self) -> float:
        return self.prefetch_correct / self.prefetch_routed if self.prefetch_routed else 0.0


class ExpertStats(ExpertStepStats):
    """The totals; ``take_step`` hands out what changed since it was last called."""

    def __init__(self) -> None:
        super().__init__()
        self._seen = ExpertStepStats()

    def snapshot(self) -> ExpertStepStats:
        return ExpertStepStats(**{f.name: getattr(self, f.name) for f in dataclasses.fields(ExpertStepStats)})

    def take_step(self) -> ExpertStepStats:
        now = self.snapshot()
        delta, self._seen = now.minus(self._seen), now
        return delta
