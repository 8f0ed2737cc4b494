"""The grammar-engine comparison as markdown tables: the schema workload, then the hostile schemas."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

BASELINE = "llguidance"


def _q(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def _fmt(value: float) -> str:
    if value != value:  # nan
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}" if abs(value) >= 0.1 else f"{value:.3f}"


Metric = Callable[[dict[str, Any]], float]

# (row label, value from a worker's result); every value is "smaller is better".
WORKLOAD_ROWS: list[tuple[str, Metric]] = [
    ("import, s (cold interpreter)", lambda r: r["import_s"]),
    ("tokenizer setup, s", lambda r: r["tokenizer_s"]),
    ("tokenizer setup, RSS MiB", lambda r: r["tokenizer_mib"]),
    ("compile p50, ms (cold)", lambda r: _q(r["compile_ms"], 0.5)),
    ("compile p99, ms", lambda r: _q(r["compile_ms"], 0.99)),
    ("compile max, ms", lambda r: max(r["compile_ms"])),
    ("compile, all schemas, s", lambda r: sum(r["compile_ms"]) / 1000),
    ("first mask p50, us (lazy work)", lambda r: _q(r["first_fill_us"], 0.5)),
    ("first mask max, us", lambda r: max(r["first_fill_us"])),
    ("compile + first mask p50, ms", lambda r: _q(_ready_ms(r), 0.5)),
    ("compile + first mask p99, ms", lambda r: _q(_ready_ms(r), 0.99)),
    ("new matcher from compiled p50, us", lambda r: _q(r["new_matcher_us"], 0.5)),
    ("mask p50, us/token, batch 1", lambda r: _q(r["fill_us"], 0.5)),
    ("mask p99, us/token, batch 1", lambda r: _q(r["fill_us"], 0.99)),
    ("mask mean, us/token, batch 1", lambda r: statistics.fmean(r["fill_us"])),
    ("consume mean, us/token, batch 1", lambda r: statistics.fmean(r["consume_us"])),
    ("batch 64 parallel: step p50, ms", lambda r: r["batch_parallel"]["step_ms_p50"]),
    ("batch 64 parallel: step p99, ms", lambda r: r["batch_parallel"]["step_ms_p99"]),
    ("batch 64 parallel: mask us/token", lambda r: r["batch_parallel"]["fill_us_per_token"]),
    ("batch 64 parallel: consume us/token", lambda r: r["batch_parallel"]["consume_us_per_token"]),
    ("batch 64 sequential: step p50, ms", lambda r: r["batch_sequential"]["step_ms_p50"]),
    ("batch 64 sequential: step p99, ms", lambda r: r["batch_sequential"]["step_ms_p99"]),
    ("batch 64 sequential: mask us/token", lambda r: r["batch_sequential"]["fill_us_per_token"]),
    ("RSS growth, all schemas compiled, MiB", lambda r: r["compile_rss_mib"]),
    ("RSS growth, after all walks, MiB", lambda r: r["after_walks_rss_mib"]),
    ("peak RSS of the process, MiB", lambda r: r["peak_rss_mib"]),
]


def _ready_ms(result: dict[str, Any]) -> list[float]:
    # Compile times are kept for compiled schemas only, first masks for those too, in order.
    return [c + f / 1000 for c, f in zip(result["compile_ms"], result["first_fill_us"])]


def workload_table(results: list[dict[str, Any]]) -> str:
    baseline = next((r for r in results if r["engine"] == BASELINE), None)
    others = [r for r in results if r is not baseline] if baseline else []
    header = [
        "metric",
        *[f"{r['engine']} {r['version']}" for r in results],
        *[f"{r['engine']} / {BASELINE}" for r in others],
    ]
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    counts = [f"{r['compiled']} / {r['walked']} of {r['schemas']}" for r in results]
    lines.append("| schemas compiled / walked | " + " | ".join(counts + [""] * len(others)) + " |")
    others_busy = [f"{r['other_cores']:.2f}" for r in results]
    lines.append("| cores other processes kept busy meanwhile | " + " | ".join(others_busy + [""] * len(others)) + " |")
    lines.append(
        "| imports torch | "
        + " | ".join(["yes" if r["imports_torch"] else "no" for r in results] + [""] * len(others))
        + " |"
    )
    for label, metric in WORKLOAD_ROWS:
        cells = [_fmt(metric(r)) for r in results]
        if baseline:
            base = metric(baseline)
            cells += [f"{metric(r) / base:.2f}x" if base > 0 else "-" for r in others]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    compiled = [_fmt(r["compiled_mib"]) if r.get("compiled_mib") is not None else "-" for r in results]
    lines.append("| compiled grammars, library's count, MiB | " + " | ".join(compiled + [""] * len(others)) + " |")
    return "\n".join(lines)


def failure_lines(results: list[dict[str, Any]]) -> list[str]:
    return [f"- {r['engine']}: {name}: {why}" for r in results for name, why in sorted(r["failures"].items())]


def walk_notes(results: list[dict[str, Any]]) -> list[str]:
    """Tokens walked, re-tokenizations the masks forced, and what Cadence's strict settings refuse."""
    notes = []
    for r in results:
        notes.append(
            f"- {r['engine']}: {r['tokens_walked']:,} tokens walked at batch 1; the mask refused the example's own "
            f"tokenization {r['resyncs']} times (the walk took the library's tokenization of those bytes instead)"
        )
        for name, why in sorted(r["strict_refusals"].items()):
            notes.append(f"  - refused under Cadence's current (non-lenient) settings: {name}: {why}")
    return notes


def hostile_cell(outcome: dict[str, Any]) -> str:
    kind = outcome["outcome"]
    if kind == "ok":
        return (
            f"ok: compile {_fmt(outcome['compile_s'])} s, +{_fmt(outcome['rss_mib'])} MiB, "
            f"mask {_fmt(outcome['fill_us_mean'])} us/tok (max {_fmt(outcome['fill_us_max'] / 1000)} ms)"
        )
    if kind == "walk failed":
        compiled = f"compiled in {_fmt(outcome['compile_s'])} s, +{_fmt(outcome['rss_mib'])} MiB"
        return f"{compiled}; walk failed: {outcome['error'][:90]}"
    if kind == "refused":
        return f"refused in {_fmt(outcome['compile_s'])} s: {outcome['error'][:110]}"
    return kind  # timeout, killed for memory, crashed


def hostile_table(cases: list[Any], outcomes: dict[tuple[str, str], dict[str, Any]], engines: list[str]) -> str:
    lines = ["| case | " + " | ".join(engines) + " |", "|---|" + "---|" * len(engines)]
    for case in cases:
        cells = [hostile_cell(outcomes[(engine, case.name)]).replace("|", "\\|") for engine in engines]
        lines.append(f"| {case.name}: {case.what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cadence_check_lines(cases: list[Any], outcomes: dict[tuple[str, str], dict[str, Any]]) -> list[str]:
    """What Cadence's own grammar_text + check_grammar say to each hostile schema (llguidance runs only)."""
    lines = []
    for case in cases:
        outcome = outcomes.get((BASELINE, case.name), {})
        if "cadence_check" in outcome:
            lines.append(f"- {case.name}: {outcome['cadence_check'] or 'accepted'}")
    return lines
