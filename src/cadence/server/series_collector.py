"""The base of every /metrics collector: a series from the catalog (server/metric_series.py)
with its samples becomes one Prometheus family, named under the server's prefix and
labelled `model_name` first."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from cadence.engine.histogram import Histogram
from cadence.server.metric_series import Series

Samples = Iterable[tuple[Sequence[str], float]]


class SeriesCollector(Collector):
    def __init__(self, model_name: str, prefix: str) -> None:
        self.model_name = model_name
        self.prefix = prefix

    def family(self, series: Series, samples: Samples) -> Metric:
        """A gauge or counter family; each sample's labels follow `series.labels`."""
        cls = GaugeMetricFamily if series.kind == "gauge" else CounterMetricFamily
        built = cls(series.full_name(self.prefix), series.doc, labels=["model_name", *series.labels])
        for labels, value in samples:
            built.add_metric([self.model_name, *labels], value)
        return built

    def one(self, series: Series, value: float) -> Metric:
        return self.family(series, [((), value)])

    def histograms(self, series: Series, samples: Iterable[tuple[Sequence[str], Histogram]]) -> Metric:
        built = HistogramMetricFamily(series.full_name(self.prefix), series.doc, labels=["model_name", *series.labels])
        for labels, histogram in samples:
            built.add_metric([self.model_name, *labels], histogram.cumulative(), histogram.total)
        return built
