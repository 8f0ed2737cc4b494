"""A wall-clock timer for short CPU calls: the median of many repeats."""

from __future__ import annotations

import time
from collections.abc import Callable


def time_call(fn: Callable[[], object], min_seconds: float = 0.3) -> float:
    """Median microseconds per call over at least `min_seconds` of repeats, after warm-up."""
    for _ in range(3):
        fn()
    samples: list[float] = []
    spent = 0.0
    while spent < min_seconds or len(samples) < 5:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        samples.append(elapsed)
        spent += elapsed
    samples.sort()
    return samples[len(samples) // 2] * 1e6
