"""A server's Prometheus /metrics text as a dict of series.

Series are keyed by sample name as it stands in the text: a counter's samples are under
`cadence:prompt_tokens_total`, a histogram's under `..._bucket`, `..._sum` and `..._count`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class MetricSample:
    """One sample: its labels and value."""

    labels: Mapping[str, str]
    value: float


def parse_metrics(text: str) -> dict[str, list[MetricSample]]:
    """Every sample of the exposition text, grouped by sample name."""
    series: dict[str, list[MetricSample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            series.setdefault(sample.name, []).append(MetricSample(dict(sample.labels), float(sample.value)))
    return series


def metric_value(series: Mapping[str, list[MetricSample]], name: str, **labels: str) -> float:
    """The sum of the samples named `name` whose labels include `labels` (0.0 when none
    match). A name the text does not have at all raises KeyError, so a misspelt name is
    not read as zero."""
    if name not in series:
        raise KeyError(f"no series named {name!r}")
    return sum(s.value for s in series[name] if all(s.labels.get(k) == v for k, v in labels.items()))
