"""GET /metrics: the engines' gauges and counts, the request and step metrics, and the
disaggregation section, under vLLM's names (server/metric_series.py).

Values are read from the engine client when Prometheus scrapes, so serving code never
touches a metrics object on its hot path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cadence.engine.kv_transfer.transfer_stats import LATENCY_BUCKETS, recommended_prefill_decode_ratio
from cadence.server import metric_series as S
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.request_metrics import RequestMetricsCollector


def _family(prefix: str, series: S.Series) -> GaugeMetricFamily | CounterMetricFamily:
    cls = GaugeMetricFamily if series.kind == "gauge" else CounterMetricFamily
    return cls(series.full_name(prefix), series.doc, labels=["model_name", *series.labels])


class EngineCollector(Collector):
    """Exports the engines' latest gauges and cumulative counts."""

    def __init__(self, client: AsyncEngineClient, model_name: str, prefix: str) -> None:
        self.client = client
        self.model_name = model_name
        self.prefix = prefix

    def _one(self, series: S.Series, value: float) -> Metric:
        family = _family(self.prefix, series)
        family.add_metric([self.model_name], value)
        return family

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats
        slots = self.client.slots.values()
        yield self._one(S.NUM_REQUESTS_RUNNING, stats.num_running)
        yield self._one(S.NUM_REQUESTS_WAITING, stats.num_waiting)
        yield self._one(S.KV_CACHE_USAGE, stats.kv_cache_usage)
        yield self._one(S.ENGINE_HEALTHY, float(self.client.is_healthy))
        preemptions = sum(slot.counters.preemptions_before for slot in slots) + stats.num_preemptions
        yield self._one(S.NUM_PREEMPTIONS, preemptions)
        yield self._one(S.ENGINE_STEPS, sum(slot.counters.steps_before for slot in slots) + stats.num_steps)
        yield self._one(S.ENGINE_RESTARTS, sum(slot.counters.restarts for slot in slots))
        info = self.client.info
        if info is not None:
            family = _family(self.prefix, S.CACHE_CONFIG_INFO)
            labels = [str(info.block_size), info.kv_cache_dtype, str(info.enable_prefix_caching)]
            family.add_metric([self.model_name, *labels, str(info.num_kv_blocks)], 1.0)
            yield family


class DisaggregationCollector(Collector):
    """Prefill/decode disaggregation: each engine's queues, the KV transfers the router
    asked for, and the prefill-to-decode ratio the traffic calls for."""

    def __init__(self, client: AsyncEngineClient, model_name: str, prefix: str) -> None:
        self.client = client
        self.model_name = model_name
        self.prefix = prefix

    def _labelled(self, series: S.Series, values: Sequence[tuple[list[str], float]]) -> Metric:
        family = _family(self.prefix, series)
        for labels, value in values:
            family.add_metric([self.model_name, *labels], value)
        return family

    def collect(self) -> Iterator[Metric]:
        coordinator = self.client.coordinator
        if coordinator is None:
            return
        slots = self.client.slots
        queues = []
        for name, slot in slots.items():
            stats = slot.stats
            for queue, value in (
                ("running", stats.num_running),
                ("waiting", stats.num_waiting),
                ("waiting_for_kv", stats.num_waiting_for_kv),
                ("holding_kv", stats.num_holding_kv),
            ):
                queues.append(([name, queue], float(value)))
        yield self._labelled(S.ENGINE_QUEUE, queues)
        transfer = coordinator.stats
        latency = HistogramMetricFamily(
            S.KV_TRANSFER_SECONDS.full_name(self.prefix), S.KV_TRANSFER_SECONDS.doc, labels=["model_name"]
        )
        cumulative, buckets = 0, []
        for bound, count in zip(LATENCY_BUCKETS, transfer.latency_buckets):
            cumulative += count
            buckets.append((repr(bound), cumulative))
        buckets.append(("+Inf", transfer.latency_count))
        latency.add_metric([self.model_name], buckets, transfer.latency_sum)
        yield latency
        outcomes = [(["complete"], transfer.num_complete), (["incomplete"], transfer.num_incomplete)]
        yield self._labelled(S.KV_TRANSFERS, outcomes)
        yield self._labelled(S.KV_TRANSFER_BYTES, [([], transfer.bytes_transferred)])
        roles = [(["prefill"], transfer.num_remote_prefills), (["decode"], transfer.num_local_prefills)]
        yield self._labelled(S.PREFILLS, roles)
        yield self._labelled(S.KV_PREFILL_REROUTES, [([], transfer.num_rerouted)])
        yield self._labelled(S.KV_EXPIRED, [([], sum(slot.stats.num_expired_kv for slot in slots.values()))])
        metrics = self.client.metrics
        ratio = recommended_prefill_decode_ratio(
            [slot.stats for slot in slots.values() if slot.role == "prefill"],
            [slot.stats for slot in slots.values() if slot.role == "decode"],
            transfer.mean_remote_prompt_tokens,
            metrics.generation_tokens / metrics.num_finished if metrics.num_finished else 0.0,
        )
        yield self._labelled(S.RECOMMENDED_PD_RATIO, [([], ratio)])


def build_registry(client: AsyncEngineClient, model_name: str, prefix: str = "cadence") -> CollectorRegistry:
    """Every collector of the server, its series named under `prefix` (metric_series.PREFIXES)."""
    if prefix not in S.PREFIXES:
        raise ValueError(f"metrics prefix must be one of {', '.join(S.PREFIXES)}, got {prefix!r}")
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(client, model_name, prefix))
    registry.register(RequestMetricsCollector(client.metrics, model_name, prefix))
    registry.register(DisaggregationCollector(client, model_name, prefix))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
