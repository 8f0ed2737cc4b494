"""Fiddler's choice, per cold expert per step: copy its weights to the GPU, or run it on
the CPU where they already are. Copying costs the expert's bytes over the host-to-device
bandwidth whatever the token count; computing on the CPU costs a fixed part (launch,
moving the tokens' activations both ways) plus a part per token. Both are measured on
the serving machine at start (``measure``); the choice is then a comparison."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuComputeCost:
    copy_seconds: float  # one expert, host to device
    cpu_fixed_seconds: float  # a CPU run's cost at zero tokens
    cpu_seconds_per_token: float

    def cpu_seconds(self, tokens: int) -> float:
        return self.cpu_fixed_seconds + self.cpu_seconds_per_token * tokens

    def prefers_cpu(self, tokens: int) -> bool:
        """Whether running ``tokens`` tokens through the expert on the CPU beats copying it."""
        return self.cpu_seconds(tokens) < self.copy_seconds

    def max_cpu_tokens(self) -> int:
        """The most tokens for which the CPU wins (0: it never does)."""
        if self.cpu_fixed_seconds >= self.copy_seconds:
            return 0
        if self.cpu_seconds_per_token <= 0:
            return 1 << 30
        spare = self.copy_seconds - self.cpu_fixed_seconds
        tokens = int(spare / self.cpu_seconds_per_token)
        return tokens if self.prefers_cpu(tokens) else max(tokens - 1, 0)


def best_of(fn: Callable[[], None], repeats: int = 3) -> float:
    """The fastest of ``repeats`` timed calls, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure(
    copy_one: Callable[[], None], run_cpu: Callable[[int], None], token_counts: tuple[int, int] = (1, 16)
) -> CpuComputeCost:
    """Time one expert's copy, and CPU runs at two token counts for a line through them."""
    low, high = token_counts
    t_low, t_high = best_of(lambda: run_cpu(low)), best_of(lambda: run_cpu(high))
    per_token = max(t_high - t_low, 0.0) / (high - low)
    return CpuComputeCost(best_of(copy_one), max(t_low - per_token * low, 0.0), per_token)
