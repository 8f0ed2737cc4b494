"""Cadence's Grafana dashboard, generated with grafana-foundation-sdk from the series
catalog (server/metric_series.py), so that a panel's query names a series /metrics
really exports.

    python -m cadence.tools.grafana_dashboard            # rewrites deploy/grafana/cadence.json
    python -m cadence.tools.grafana_dashboard --check    # exit 1 if the committed file is stale

Template variables: `DS_PROMETHEUS` (the Prometheus datasource) and `model_name`.
Queries use the `cadence:` prefix; a server run with `--metrics-prefix vllm` feeds
vLLM's own dashboards instead.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from grafana_foundation_sdk.builders import dashboard, heatmap, prometheus, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.dashboard import DataSourceRef

from cadence.server import metric_series as S
from cadence.tools.generated_file import write_or_check

OUTPUT = Path(__file__).resolve().parents[3] / "deploy" / "grafana" / "cadence.json"
PREFIX = "cadence"
DATASOURCE = DataSourceRef(type_val="prometheus", uid="${DS_PROMETHEUS}")
MODEL = 'model_name="$model_name"'
WINDOW = "$__rate_interval"


def name(series: S.Series, suffix: str = "") -> str:
    """The exported name of a series (counters get `_total`, histograms `_bucket` etc.)."""
    total = "_total" if series.kind == "counter" and not suffix else ""
    return f"{series.full_name(PREFIX)}{total}{suffix}"


def rate(series: S.Series, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping}(rate({name(series)}{{{MODEL}}}[{WINDOW}]))"


def quantile(series: S.Series, q: float, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({name(series, '_bucket')}{{{MODEL}}}[{WINDOW}])))"


def gauge(series: S.Series, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping}({name(series)}{{{MODEL}}})"


def percentiles(series: S.Series) -> list[tuple[str, str]]:
    return [(quantile(series, q), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)]


def panel(title: str, unit: str, targets: list[tuple[str, str]], description: str = "") -> timeseries.Panel:
    built = timeseries.Panel().title(title).unit(unit).datasource(DATASOURCE).height(8).span(8)
    if description:
        built = built.description(description)
    for index, (expr, legend) in enumerate(targets):
        query = prometheus.Dataquery().expr(expr).legend_format(legend).ref_id(chr(ord("A") + index))
        built = built.with_target(query.datasource(DATASOURCE))
    return built


def length_heatmap(title: str, series: S.Series) -> heatmap.Panel:
    expr = f"sum by (le) (increase({name(series, '_bucket')}{{{MODEL}}}[{WINDOW}]))"
    query = prometheus.Dataquery().expr(expr).format("heatmap").legend_format("{{le}}").ref_id("A")
    return heatmap.Panel().title(title).datasource(DATASOURCE).height(8).span(12).with_target(query)


def serving_panels() -> list[timeseries.Panel | heatmap.Panel]:
    hit_rate = f"{rate(S.PREFIX_CACHE_HITS)} / {rate(S.PREFIX_CACHE_QUERIES)}"
    return [
        panel("Time to first token", "s", percentiles(S.TTFT)),
        panel("Inter-token latency", "s", percentiles(S.ITL)),
        panel("End-to-end latency", "s", percentiles(S.E2E_LATENCY)),
        panel(
            "Token throughput",
            "tokens/s",
            [(rate(S.PROMPT_TOKENS), "prompt"), (rate(S.GENERATION_TOKENS), "generation")],
        ),
        panel(
            "Requests running and waiting",
            "none",
            [(gauge(S.NUM_REQUESTS_RUNNING), "running"), (gauge(S.NUM_REQUESTS_WAITING), "waiting")],
        ),
        panel("KV-cache usage", "percentunit", [(gauge(S.KV_CACHE_USAGE), "usage")]),
        panel("Prefix-cache hit rate", "percentunit", [(hit_rate, "hit rate")], "Prompt tokens found / looked up."),
        panel("Preemptions", "ops", [(rate(S.NUM_PREEMPTIONS), "preemptions/s")]),
        panel("Queue time", "s", percentiles(S.QUEUE_TIME)),
        length_heatmap("Prompt length", S.REQUEST_PROMPT_TOKENS),
        length_heatmap("Generation length", S.REQUEST_GENERATION_TOKENS),
        panel("Finish reasons", "reqps", [(rate(S.REQUEST_SUCCESS, "finished_reason"), "{{finished_reason}}")]),
        panel(
            "Engine step time by kind",
            "s",
            [(quantile(S.STEP_SECONDS, q, "kind"), f"{{{{kind}}}} p{round(q * 100)}") for q in (0.5, 0.99)],
        ),
        panel("Engine batch size by kind", "none", [(quantile(S.STEP_BATCH_SIZE, 0.5, "kind"), "{{kind}} p50")]),
        panel("Admission rejections", "reqps", [(rate(S.ADMISSION_REJECTIONS, "reason"), "{{reason}}")]),
    ]


def disaggregation_panels() -> list[timeseries.Panel | heatmap.Panel]:
    return [
        panel("KV transfer latency", "s", percentiles(S.KV_TRANSFER_SECONDS)),
        panel("KV bytes transferred", "Bps", [(rate(S.KV_TRANSFER_BYTES), "bytes/s")]),
        panel("KV transfers by outcome", "ops", [(rate(S.KV_TRANSFERS, "outcome"), "{{outcome}}")]),
        panel("Prompts by where computed", "ops", [(rate(S.PREFILLS, "engine_role"), "{{engine_role}} engine")]),
        panel(
            "Reroutes and expired KV",
            "ops",
            [(rate(S.KV_PREFILL_REROUTES), "rerouted"), (rate(S.KV_EXPIRED), "expired")],
        ),
        panel("Engine queues", "none", [(gauge(S.ENGINE_QUEUE, "engine, queue"), "{{engine}} {{queue}}")]),
        panel("Recommended prefill:decode ratio", "none", [(gauge(S.RECOMMENDED_PD_RATIO), "prefill per decode")]),
    ]


def expert_panels() -> list[timeseries.Panel | heatmap.Panel]:
    hits, misses = rate(S.EXPERT_CACHE_HITS), rate(S.EXPERT_CACHE_MISSES)
    return [
        panel("Expert cache hit rate", "percentunit", [(f"{hits} / ({hits} + {misses})", "hit rate")]),
        panel("Expert bytes loaded", "Bps", [(rate(S.EXPERT_LOAD_BYTES), "bytes/s")]),
        panel("Expert stall", "percentunit", [(rate(S.EXPERT_STALL_SECONDS), "share of time waiting")]),
    ]


ROWS = {
    "Serving": serving_panels,
    "Prefill/decode disaggregation": disaggregation_panels,
    "Expert offloading": expert_panels,
}


def build() -> dict:
    board = (
        dashboard.Dashboard("Cadence")
        .uid("cadence-overview")
        .tags(["cadence", "llm"])
        .refresh("30s")
        .time("now-1h", "now")
        .with_variable(dashboard.DatasourceVariable("DS_PROMETHEUS").label("Prometheus").type("prometheus"))
        .with_variable(
            dashboard.QueryVariable("model_name")
            .label("Model")
            .datasource(DATASOURCE)
            .query(f"label_values({name(S.NUM_REQUESTS_RUNNING)}, model_name)")
            .refresh(1)
        )
    )
    for title, panels in ROWS.items():
        board = board.with_row(dashboard.Row(title))
        for built in panels():
            board = board.with_panel(built)
    return json.loads(JSONEncoder(sort_keys=True, indent=2).encode(board.build()))


def queries(board: dict) -> list[str]:
    """Every PromQL expression of the dashboard's panels and variables."""
    found = [target["expr"] for p in board["panels"] for target in p.get("targets", [])]
    return found + [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]


def render() -> str:
    return json.dumps(build(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(OUTPUT, render(), "cadence.tools.grafana_dashboard", __doc__ or "", argv)


if __name__ == "__main__":
    sys.exit(main())
