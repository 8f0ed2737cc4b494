"""The server's own view of a run, from its Prometheus /metrics: before, during and after.

Counters are reported as deltas over the run, so they compare directly with the client's
totals (prompt and generation tokens, finished requests by reason). Gauges (running,
waiting, KV-cache use) are sampled at an interval into a time series. Series are found
under either prefix, `vllm:` or `cadence:`, so the same report works against both servers.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp

from cadence.client.metrics import MetricSample, parse_metrics
from cadence.loadgen.request import Target

Series = dict[str, list[MetricSample]]
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
# Counters whose run deltas are set beside the client's own counts.
KEY_COUNTERS = ("prompt_tokens_total", "generation_tokens_total", "num_preemptions_total")
LATENCY_HISTOGRAMS = ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds")
# Seconds one scrape may take: a server that hangs on /metrics must not hold up the run's end.
SCRAPE_TIMEOUT = 10.0


def _key(name: str, sample: MetricSample) -> str:
    labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "model_name")
    return f"{name}{{{labels}}}" if labels else name


def flatten(series: Series) -> dict[str, float]:
    """One value per name and labels, model_name left out: samples of several models add up."""
    flat: dict[str, float] = {}
    for name, samples in series.items():
        for s in samples:
            key = _key(name, s)
            flat[key] = flat.get(key, 0.0) + s.value
    return flat


def find_prefix(series: Series) -> str | None:
    for name in series:
        if name.endswith(":num_requests_running"):
            return name.split(":", 1)[0]
    return None


class MetricsScraper:
    """Scrapes one server's /metrics around a run; a server without /metrics is reported as such."""

    def __init__(self, session: aiohttp.ClientSession, target: Target, interval: float) -> None:
        self.session = session
        self.url = target.base_url + "/metrics"
        self.headers = target.headers
        self.interval = interval
        self.before: Series | None = None
        self.after: Series | None = None
        self.prefix: str | None = None
        self.timeline: list[dict[str, float]] = []
        self.error = ""
        self.seconds_to_idle: float | None = None  # after the run; None when it never got there
        self._task: asyncio.Task[None] | None = None
        self._start = 0.0

    async def scrape(self) -> Series | None:
        try:
            timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT)
            async with self.session.get(self.url, headers=self.headers, timeout=timeout) as response:
                if response.status != 200:
                    self.error = f"/metrics answered HTTP {response.status}"
                    return None
                text = await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError) as error:
            self.error = f"/metrics: {type(error).__name__}: {error}"
            return None
        try:
            return parse_metrics(text)
        except ValueError as error:  # a 200 that is not Prometheus text (a proxy's page, say)
            self.error = f"/metrics is not Prometheus text: {error}"
            return None

    def gauge(self, series: Series, name: str) -> float | None:
        if self.prefix is None:
            return None
        samples = series.get(f"{self.prefix}:{name}")
        return sum(s.value for s in samples) if samples else None

    async def scrape_before(self) -> None:
        """The scrape the run's deltas count from; taken before the run's clock starts."""
        self.before = await self.scrape()
        if self.before is not None:
            self.prefix = find_prefix(self.before)

    def begin(self, run_start: float) -> None:
        """Sample the gauges every `interval` seconds from the run's start (a perf_counter
        reading). The scrape taken just before the start is the timeline's first point, at
        0 s: a run shorter than the interval still has one, and no scrape competes with the
        first requests."""
        self._start = run_start
        if self.before is not None and self.interval > 0:
            self.timeline.append(self._point(self.before, 0.0))
            self._task = asyncio.create_task(self._sample_loop())

    def cancel(self) -> None:
        """Stop sampling at once (the run is over, or failed)."""
        if self._task is not None:
            self._task.cancel()

    async def _sample_loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            series = await self.scrape()
            if series is not None:
                self.timeline.append(self._point(series, time.perf_counter() - self._start))

    def _point(self, series: Series, t: float) -> dict[str, float]:
        point = {"t": t}
        for name in GAUGES:
            value = self.gauge(series, name)
            if value is not None:
                point[name] = value
        return point

    async def stop(self, idle_timeout: float) -> None:
        """End the sampling; wait for the server to settle (aborts are freed asynchronously), then scrape."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self.before is not None:
            self.seconds_to_idle = await self.wait_idle(idle_timeout)
            self.after = await self.scrape()

    async def wait_idle(self, timeout: float) -> float | None:
        """Seconds until the server reports nothing running or waiting; None if it never did."""
        if self.prefix is None:
            return None
        start = time.perf_counter()
        while True:
            series = await self.scrape()
            if series is not None:
                busy = [self.gauge(series, name) for name in GAUGES[:2]]
                if all(v is not None and v == 0 for v in busy):
                    return time.perf_counter() - start
            if time.perf_counter() - start > timeout:
                return None
            await asyncio.sleep(0.2)

    def report(self) -> dict[str, Any]:
        if self.before is None or self.after is None or self.prefix is None:
            return {"available": False, "error": self.error or "no series named *:num_requests_running"}
        before, after = flatten(self.before), flatten(self.after)
        deltas = {k: v - before.get(k, 0.0) for k, v in after.items() if _is_counter(k) and v != before.get(k, 0.0)}
        prefix = self.prefix + ":"
        key: dict[str, Any] = {name.removesuffix("_total"): _sum_of(deltas, prefix + name) for name in KEY_COUNTERS}
        finished: dict[str, float] = {}
        for k, v in deltas.items():
            if k.startswith(prefix + "request_success_total{") and 'finished_reason="' in k:
                # Summed over any other label (vLLM's `engine`, one per data-parallel rank).
                reason = k.split('finished_reason="', 1)[1].split('"', 1)[0]
                finished[reason] = finished.get(reason, 0.0) + v
        key["request_success"] = finished
        for name in LATENCY_HISTOGRAMS:
            count = _sum_of(deltas, f"{prefix}{name}_count")
            key[f"mean_{name.removesuffix('_seconds')}_ms"] = (
                _sum_of(deltas, f"{prefix}{name}_sum") / count * 1000.0 if count else None
            )
        return {
            "available": True,
            "prefix": self.prefix,
            "idle_after_run": self.seconds_to_idle is not None,
            "seconds_to_idle": self.seconds_to_idle,
            "key": key,
            "deltas": deltas,
            "timeline": self.timeline,
        }


def _is_counter(key: str) -> bool:
    name = key.split("{", 1)[0]
    return name.endswith(("_total", "_count", "_sum")) or "_bucket" in name


def _sum_of(deltas: dict[str, float], name: str) -> float:
    return sum(v for k, v in deltas.items() if k == name or k.startswith(name + "{"))
