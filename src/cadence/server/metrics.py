"""GET /metrics: the engines' gauges and counts, the request and step metrics, and the
disaggregation section, under vLLM's names (server/metric_series.py).

Values are read from the engine client when Prometheus scrapes, so serving code never
touches a metrics object on its hot path.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric

from cadence.server import metric_series as S
from cadence.server.disaggregation.transfer_stats import recommended_prefill_decode_ratio
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.request_metrics import RequestMetricsCollector
from cadence.server.series_collector import SeriesCollector


class EngineCollector(SeriesCollector):
    """Exports the engines' latest gauges and cumulative counts."""

    def __init__(self, client: AsyncEngineClient, model_name: str, prefix: str) -> None:
        super().__init__(model_name, prefix)
        self.client = client

    def collect(self) -> Iterator[Metric]:
        stats = self.client.stats
        engines = self.client.engines.values()
        yield self.one(S.NUM_REQUESTS_RUNNING, stats.num_running)
        yield self.one(S.NUM_REQUESTS_WAITING, stats.num_waiting)
        yield self.one(S.KV_CACHE_USAGE, stats.kv_cache_usage)
        yield self.one(S.ENGINE_HEALTHY, float(self.client.is_healthy))
        preemptions = sum(engine.counters.preemptions_before for engine in engines) + stats.num_preemptions
        yield self.one(S.NUM_PREEMPTIONS, preemptions)
        yield self.one(S.ENGINE_STEPS, sum(engine.counters.steps_before for engine in engines) + stats.num_steps)
        yield self.one(S.ENGINE_RESTARTS, sum(engine.counters.restarts for engine in engines))
        info = self.client.info
        if info is not None:
            labels = (
                str(info.block_size),
                info.kv_cache_dtype,
                str(info.enable_prefix_caching),
                str(info.num_kv_blocks),
            )
            yield self.family(S.CACHE_CONFIG_INFO, [(labels, 1.0)])


class DisaggregationCollector(SeriesCollector):
    """Prefill/decode disaggregation: each engine's queues, the KV transfers the router
    asked for, and the prefill-to-decode ratio the traffic calls for."""

    def __init__(self, client: AsyncEngineClient, model_name: str, prefix: str) -> None:
        super().__init__(model_name, prefix)
        self.client = client

    def collect(self) -> Iterator[Metric]:
        coordinator = self.client.coordinator
        if coordinator is None:
            return
        engines = self.client.engines
        queues = []
        for name, engine in engines.items():
            stats = engine.stats
            for queue, value in (
                ("running", stats.num_running),
                ("waiting", stats.num_waiting),
                ("waiting_for_kv", stats.num_waiting_for_kv),
                ("holding_kv", stats.num_holding_kv),
            ):
                queues.append(((name, queue), float(value)))
        yield self.family(S.ENGINE_QUEUE, queues)
        transfer = coordinator.stats
        yield self.histograms(S.KV_TRANSFER_SECONDS, [((), transfer.latency)])
        outcomes = [(("complete",), transfer.num_complete), (("incomplete",), transfer.num_incomplete)]
        yield self.family(S.KV_TRANSFERS, outcomes)
        yield self.one(S.KV_TRANSFER_BYTES, transfer.bytes_transferred)
        roles = [(("prefill",), transfer.num_remote_prefills), (("decode",), transfer.num_local_prefills)]
        yield self.family(S.PREFILLS, roles)
        yield self.one(S.KV_PREFILL_REROUTES, transfer.num_rerouted)
        yield self.one(S.KV_EXPIRED, sum(engine.stats.num_expired_kv for engine in engines.values()))
        metrics = self.client.metrics
        ratio = recommended_prefill_decode_ratio(
            [engine.stats for engine in engines.values() if engine.role == "prefill"],
            [engine.stats for engine in engines.values() if engine.role == "decode"],
            transfer.mean_remote_prompt_tokens,
            metrics.generation_tokens / metrics.num_finished if metrics.num_finished else 0.0,
        )
        yield self.one(S.RECOMMENDED_PD_RATIO, ratio)


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
