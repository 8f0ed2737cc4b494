"""Several runs: a sweep over request rates or concurrencies, and a search for capacity.

Capacity is the highest request rate at which the chosen percentile of every SLO is met
and no request fails. The search doubles the rate while it passes (or halves it while it
fails), then bisects between the last pass and the first failure. It is bounded by a
number of probes, each a full run of `--num-prompts` requests on a fresh prompt set.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cadence.loadgen.stats import SLO

# (the swept value, the point's index) -> that run's summary
Probe = Callable[[float, int], Awaitable[dict[str, Any]]]
SWEEP_AXES = ("request-rate", "max-concurrency")


@dataclass(frozen=True)
class SweepSpec:
    axis: str
    values: list[float]

    @staticmethod
    def parse(text: str) -> SweepSpec:
        """`request-rate=1,2,4,inf` or `max-concurrency=1,8,32`."""
        axis, sep, values = text.partition("=")
        if not sep or axis not in SWEEP_AXES:
            raise ValueError(f"--sweep is request-rate=V1,V2,... or max-concurrency=V1,V2,..., not {text!r}")
        parsed = [float(v) for v in values.split(",") if v.strip()]
        if not parsed or any(not v > 0 for v in parsed):
            raise ValueError("--sweep values must be positive")
        if axis == "max-concurrency" and any(math.isinf(v) or v != int(v) for v in parsed):
            raise ValueError("--sweep max-concurrency values must be whole numbers")
        return SweepSpec(axis, parsed)


async def run_sweep(spec: SweepSpec, probe: Probe) -> list[tuple[float, dict[str, Any]]]:
    return [(value, await probe(value, i)) for i, value in enumerate(spec.values)]


@dataclass(frozen=True)
class CapacitySearch:
    slo: SLO
    at_percentile: float = 90.0
    start_rate: float = 1.0
    tolerance: float = 0.1  # stop when the bracket is this narrow, relative to its low end
    max_probes: int = 8
    min_rate: float = 1.0 / 64

    def passes(self, summary: dict[str, Any]) -> bool:
        return summary["failed"] == 0 and summary["completed"] > 0 and self.slo.met_at(summary, self.at_percentile)


async def find_capacity(
    search: CapacitySearch, probe: Probe
) -> tuple[float | None, list[tuple[float, dict[str, Any]]]]:
    """The highest passing rate found (None if even the lowest failed), and every probe made."""
    if not search.slo.limits_ms:
        raise ValueError("--find-capacity needs an SLO: --goodput ttft:MS tpot:MS ...")
    points: list[tuple[float, dict[str, Any]]] = []

    async def passes(rate: float) -> bool:
        summary = await probe(rate, len(points))
        points.append((rate, summary))
        return search.passes(summary)

    rate = search.start_rate
    low: float | None = None
    high: float | None = None
    # Bracket: double while passing, halve while failing.
    while len(points) < search.max_probes:
        if await passes(rate):
            low = rate
            if high is not None:
                break
            rate *= 2
        else:
            high = rate
            if low is not None or rate / 2 < search.min_rate:
                break
            rate /= 2
    # Narrow: bisect between the last pass and the first failure.
    while low is not None and high is not None and len(points) < search.max_probes:
        if (high - low) / low <= search.tolerance:
            break
        middle = (low + high) / 2
        if await passes(middle):
            low = middle
        else:
            high = middle
    return low, points
