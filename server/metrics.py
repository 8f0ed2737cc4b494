"""GET /metrics: the basic counters and gauges, with vLLM's names under `cadence:`.

Values are read from the engine client when Prometheus scrapes, so serving code never
touches a metrics object on its hot path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cadence.engine.kv_transfer.transfer_stats import LATENCY_BUCKETS, recommended_prefill_decode_ratio
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


class DisaggregationCollector(Collector):
    """Prefill/decode disaggregation: each engine's queues, the KV transfers the router
    asked for, and the prefill-to-decode ratio the traffic calls for."""

    def __init__(self, client: AsyncEngineClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        coordinator = self.client.coordinator
        if coordinator is None:
            return
        labels = [self.model_name]
        queues = GaugeMetricFamily(
            "cadence:engine_queue", "Sequences per engine and queue.", labels=["model_name", "engine", "queue"]
        )
        for name, slot in self.client.slots.items():
            stats = slot.stats
            for queue, value in (
                ("running", stats.num_running),
                ("waiting", stats.num_waiting),
                ("waiting_for_kv", stats.num_waiting_for_kv),
                ("holding_kv", stats.num_holding_kv),
            ):
                queues.add_metric([self.model_name, name, queue], value)
        yield queues
        transfer = coordinator.stats
        latency = HistogramMetricFamily(
            "cadence:kv_transfer_seconds",
            "Seconds from asking a decode engine to load a prompt's KV to hearing it arrived (or not).",
            labels=["model_name"],
        )
        cumulative, buckets = 0, []
        for bound, count in zip(LATENCY_BUCKETS, transfer.latency_buckets):
            cumulative += count
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", transfer.latency_count))
        latency.add_metric(labels, buckets, transfer.latency_sum)
        yield latency
        loads = CounterMetricFamily(
            "cadence:kv_transfers", "Prompt KV loads by outcome.", labels=["model_name", "outcome"]
        )
        loads.add_metric([self.model_name, "complete"], transfer.num_complete)
        loads.add_metric([self.model_name, "incomplete"], transfer.num_incomplete)
        yield loads
        moved = CounterMetricFamily(
            "cadence:kv_transfer_bytes", "KV bytes loaded across engines.", labels=["model_name"]
        )
        moved.add_metric(labels, transfer.bytes_transferred)
        yield moved
        prefills = CounterMetricFamily(
            "cadence:prefills", "Prompts by where they were computed.", labels=["model_name", "engine_role"]
        )
        prefills.add_metric([self.model_name, "prefill"], transfer.num_remote_prefills)
        prefills.add_metric([self.model_name, "decode"], transfer.num_local_prefills)
        yield prefills
        rerouted = CounterMetricFamily(
            "cadence:kv_prefill_reroutes",
            "Prompts sent to another prefill engine after theirs died.",
            labels=["model_name"],
        )
        rerouted.add_metric(labels, transfer.num_rerouted)
        yield rerouted
        expired = CounterMetricFamily(
            "cadence:kv_expired",
            "Waits for KV and holds of KV that ran out of time, all engines.",
            labels=["model_name"],
        )
        expired.add_metric(labels, sum(slot.stats.num_expired_kv for slot in self.client.slots.values()))
        yield expired
        counters = self.client.counters
        finished = sum(counters.finished.values())
        ratio = recommended_prefill_decode_ratio(
            [slot.stats for slot in self.client.slots.values() if slot.role == "prefill"],
            [slot.stats for slot in self.client.slots.values() if slot.role == "decode"],
            transfer.mean_remote_prompt_tokens,
            counters.generation_tokens / finished if finished else 0.0,
        )
        recommended = GaugeMetricFamily(
            "cadence:recommended_prefill_decode_ratio",
            "Prefill engines per decode engine that would keep both equally busy under the current traffic "
            "(0 until both have worked).",
            labels=["model_name"],
        )
        recommended.add_metric(labels, ratio)
        yield recommended


def build_registry(client: AsyncEngineClient, model_name: str) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(client, model_name))
    registry.register(DisaggregationCollector(client, model_name))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
