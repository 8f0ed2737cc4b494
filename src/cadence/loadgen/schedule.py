"""When each request is due: gamma-distributed gaps, as `vllm bench serve` draws them.

With burstiness 1 the gaps are exponential (a Poisson process); below 1 arrivals bunch
up, above 1 they even out. The mean rate is `request_rate` whatever the burstiness.
"""

from __future__ import annotations

import math

import numpy as np


def arrival_offsets(count: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds from the run's start at which each of `count` requests is due."""
    if count < 1:
        return []
    if not burstiness > 0:
        raise ValueError("--burstiness must be positive")
    if math.isinf(request_rate):
        return [0.0] * count
    if not request_rate > 0:
        raise ValueError("--request-rate must be positive (or inf)")
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=count)
    # The first request goes out at once; the gaps fall between requests.
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]
