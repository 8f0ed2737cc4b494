"""GET /metrics: the basic counters and gauges, with vLLM's names under `cadence:`.

Values are read from the engine client when Prometheus scrapes, so serving code never
touches a metrics object on its hot path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from cadence.server.engine_client import AsyncEngineClient


class EngineCollector(Collector):
    """Exports the engine's latest stats and the front end's request counters."""

    def __init__(self, client: AsyncEngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=["model_name"])
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats
        counters = self.client.counters
        slots = self.client.slots.values()
        yield self._gauge("cadence:num_requests_running", "Sequences in the engine's running batch.", stats.num_running)
        yield self._gauge("cadence:num_requests_waiting", "Sequences waiting to be scheduled.", stats.num_waiting)
        yield self._gauge(
            "cadence:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).", stats.kv_cache_usage
        )
        yield self._gauge(
            "cadence:engine_healthy", "1 while the engine process serves, else 0.", float(self.client.is_healthy)
        )
        yield self._counter(
            "cadence:num_preemptions",
            "Sequences preempted for lack of KV blocks.",
            sum(slot.counters.preemptions_before for slot in slots) + stats.num_preemptions,
        )
        yield self._counter(
            "cadence:engine_steps",
            "Engine steps (one forward pass each) run.",
            sum(slot.counters.steps_before for slot in slots) + stats.num_steps,
        )
        yield self._counter(
            "cadence:engine_restarts",
            "Times the engine process was started again after dying.",
            sum(slot.counters.restarts for slot in slots),
        )
        yield self._counter("cadence:prompt_tokens", "Prompt tokens of admitted requests.", counters.prompt_tokens)
        yield self._counter("cadence:generation_tokens", "Tokens generated.", counters.generation_tokens)
        success = CounterMetricFamily(
            "cadence:request_success",
            "Sequences that ended, by finish reason (abort included).",
            labels=["model_name", "finished_reason"],
        )
        for reason, count in sorted(counters.finished.items()):
            success.add_metric([self.model_name, reason], count)
        yield success


def build_registry(client: AsyncEngineClient, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(client, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
