"""Bucket counts for a Prometheus-style histogram, kept by whoever observes (the API
process's request metrics, the router's KV-transfer latencies) without a lock or a
Prometheus object; exporters turn them into families only when scraped."""

from __future__ import annotations

import bisect


class Histogram:
    """Counts per bucket; `bounds` are the finite upper bounds (le), +Inf is implied."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one: above every bound
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations at or below it) per bucket, +Inf last: Prometheus's form."""
        buckets: list[tuple[str, float]] = []
        running = 0
        for bound, count in zip(self.bounds, self.counts):
            running += count
            buckets.append((repr(float(bound)), running))
        buckets.append(("+Inf", running + self.counts[-1]))
        return buckets
