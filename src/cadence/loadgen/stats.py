"""A run's summary under `vllm bench serve`'s field names, and goodput against SLOs.

Latency fields are milliseconds; the per-request lists (`ttfts`, `itls`) are seconds, as
vLLM writes them. Percentiles interpolate linearly between ranks (numpy's default, which
vLLM uses too), so the two tools agree on the same latencies.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cadence.loadgen.records import RequestRecord, RunResult

METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; a request is good when it meets every one set."""

    limits_ms: dict[str, float]

    @staticmethod
    def parse(items: Iterable[str]) -> SLO:
        """From `vllm bench serve --goodput` items such as `ttft:500 tpot:50 e2el:8000`."""
        limits: dict[str, float] = {}
        for item in items:
            name, sep, value = item.partition(":")
            if not sep or name not in ("ttft", "tpot", "e2el"):
                raise ValueError(f"an SLO is ttft:MS, tpot:MS or e2el:MS, not {item!r}")
            limit = float(value)
            if not limit > 0:
                raise ValueError(f"an SLO limit must be a positive number of milliseconds, not {value!r}")
            limits[name] = limit
        return SLO(limits)

    def met_by(self, record: RequestRecord) -> bool:
        values = {"ttft": record.ttft, "tpot": record.tpot, "e2el": record.e2el}
        for name, limit in self.limits_ms.items():
            value = values[name]
            # A one-token answer has no TPOT; it cannot miss that objective.
            if value is not None and value * 1000.0 > limit:
                return False
        return record.success

    def met_at(self, summary: dict[str, Any], at: float) -> bool:
        """Whether the run's `at`-th percentile of every objective is within its limit."""
        for name, limit in self.limits_ms.items():
            key = f"p{at:g}_{name}_ms"
            if key not in summary:
                raise KeyError(f"the run's summary has no {key}: summarize it with percentile {at:g}")
            if not summary[key] <= limit:  # NaN (nothing measured) fails too
                return False
        return True


def metric_values(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    """Seconds, per metric, over the successful requests."""
    return {
        "ttft": [t for r in records if (t := r.ttft) is not None],
        "tpot": [t for r in records if (t := r.tpot) is not None],
        "itl": [gap for r in records for gap in r.itls],
        "e2el": [r.e2el for r in records],
    }


def peak_output_rate(records: Sequence[RequestRecord], bucket: float = 1.0) -> float:
    """The most text chunks received in any `bucket` seconds, per second (vLLM's max_output_tokens_per_s)."""
    counts: dict[int, int] = {}
    for r in records:
        for t in r.token_times:
            key = int(t // bucket)
            counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0) / bucket


def peak_concurrency(records: Sequence[RequestRecord]) -> int:
    """The most requests in flight at once, from their send and completion times (never sent: never in flight)."""
    sent = [(r.sent, r.done) for r in records if r.sent is not None]
    events = sorted([(start, 1) for start, _ in sent] + [(end, -1) for _, end in sent])
    running = peak = 0
    for _, step in events:
        running += step
        peak = max(peak, running)
    return peak


def summarize(result: RunResult, percentiles: Sequence[float] = (99.0,), slo: SLO | None = None) -> dict[str, Any]:
    """The run's figures; only `normal` requests count toward throughput and latency."""
    normal = result.normal
    good = result.succeeded
    duration = result.duration if result.duration > 0 else math.nan
    input_tokens = sum(r.input_tokens for r in good)
    output_tokens = sum(r.output_tokens for r in good)
    summary: dict[str, Any] = {
        "request_rate": result.settings.request_rate,
        "burstiness": result.settings.burstiness,
        "max_concurrency": result.settings.max_concurrency,
        "num_prompts": result.settings.num_prompts,
        "duration": result.duration,
        "completed": len(good),
        "failed": len(normal) - len(good),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(good) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "max_output_tokens_per_s": peak_output_rate(good),
        "max_concurrent_requests": peak_concurrency(result.records),
    }
    if slo is not None:
        summary["request_goodput"] = sum(1 for r in good if slo.met_by(r)) / duration
        summary["goodput_slo_ms"] = dict(slo.limits_ms)
    values = metric_values(good)
    for name in METRICS:
        ms = [v * 1000.0 for v in values[name]]
        summary[f"mean_{name}_ms"] = statistics.fmean(ms) if ms else math.nan
        summary[f"median_{name}_ms"] = percentile(ms, 50)
        summary[f"std_{name}_ms"] = float(np.std(ms)) if ms else math.nan
        for q in percentiles:
            summary[f"p{q:g}_{name}_ms"] = percentile(ms, q)
    # What reached the server, aborted streams included: the figures its counters compare with.
    answered = [r for r in result.records if r.status == 200]
    summary["streamed_input_tokens"] = sum(r.input_tokens for r in answered)
    summary["streamed_output_tokens"] = sum(r.output_tokens for r in answered)
    delays = [d * 1000.0 for r in normal if (d := r.send_delay) is not None]
    summary["mean_send_delay_ms"] = statistics.fmean(delays) if delays else math.nan
    summary["p99_send_delay_ms"] = percentile(delays, 99)
    lag = [v * 1000.0 for v in result.health.loop_lag]
    summary["p99_harness_loop_lag_ms"] = percentile(lag, 99)
    summary["max_harness_loop_lag_ms"] = max(lag, default=math.nan)
    summary["input_lens"] = [r.input_tokens for r in normal]
    summary["output_lens"] = [r.output_tokens for r in normal]
    summary["ttfts"] = [r.ttft for r in normal]
    summary["itls"] = [r.itls for r in normal]
    summary["generated_texts"] = [r.generated_text for r in normal]
    summary["errors"] = [r.error for r in normal]
    return summary
