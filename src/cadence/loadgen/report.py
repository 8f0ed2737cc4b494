"""What a run prints and saves: a summary table, the result JSON and a per-request detail file."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cadence.loadgen.records import RunResult

LATENCY_TITLES = {
    "ttft": "Time to first token",
    "tpot": "Time per output token (after the first)",
    "itl": "Inter-token latency",
    "e2el": "End-to-end latency",
}


def _line(label: str, value: Any, width: int = 48) -> str:
    if isinstance(value, float):
        value = "n/a" if math.isnan(value) else f"{value:.2f}"
    return f"{label:<{width}}{value}"


def summary_table(summary: dict[str, Any], percentiles: Sequence[float], server: dict[str, Any] | None) -> str:
    rate = summary["request_rate"]
    lines = [
        "=" * 24 + " Load generator result " + "=" * 24,
        _line("Request rate (req/s)", "inf" if math.isinf(rate) else rate),
        _line("Burstiness", summary["burstiness"]),
        _line("Max concurrency", summary["max_concurrency"] or "none"),
        _line("Successful requests", summary["completed"]),
        _line("Failed requests", summary["failed"]),
        _line("Duration (s)", summary["duration"]),
        _line("Total input tokens", summary["total_input_tokens"]),
        _line("Total generated tokens", summary["total_output_tokens"]),
        _line("Request throughput (req/s)", summary["request_throughput"]),
        _line("Output token throughput (tok/s)", summary["output_throughput"]),
        _line("Peak output throughput (chunks/s)", summary["max_output_tokens_per_s"]),
        _line("Total token throughput (tok/s)", summary["total_token_throughput"]),
        _line("Peak concurrent requests", summary["max_concurrent_requests"]),
    ]
    if "request_goodput" in summary:
        limits = " ".join(f"{k}:{v:g}" for k, v in summary["goodput_slo_ms"].items())
        lines.append(_line(f"Request goodput (req/s, {limits} ms)", summary["request_goodput"]))
    for name, title in LATENCY_TITLES.items():
        lines.append(f"{'-' * 4} {title} (ms, from when due) ".ljust(71, "-"))
        lines.append(_line(f"Mean {name.upper()}", summary[f"mean_{name}_ms"]))
        lines.append(_line(f"Median {name.upper()}", summary[f"median_{name}_ms"]))
        for q in percentiles:
            lines.append(_line(f"P{q:g} {name.upper()}", summary[f"p{q:g}_{name}_ms"]))
    lines.append(f"{'-' * 4} The harness itself ".ljust(71, "-"))
    lines.append(_line("Mean send delay, due to sent (ms)", summary["mean_send_delay_ms"]))
    lines.append(_line("P99 send delay (ms)", summary["p99_send_delay_ms"]))
    lines.append(_line("P99 event-loop lag (ms)", summary["p99_harness_loop_lag_ms"]))
    if server is not None:
        lines.extend(_server_lines(server, summary))
    lines.append("=" * 71)
    return "\n".join(lines)


def _server_lines(server: dict[str, Any], summary: dict[str, Any]) -> list[str]:
    lines = [f"{'-' * 4} The server's /metrics over the run ".ljust(71, "-")]
    if not server.get("available"):
        return [*lines, f"not available: {server.get('error', '')}"]
    key = server["key"]
    # The client's side counts every stream the server answered, aborted ones included.
    streamed = (summary["streamed_input_tokens"], summary["streamed_output_tokens"])
    lines.append(_line("Prompt tokens (server / client)", f"{key['prompt_tokens']:g} / {streamed[0]}"))
    lines.append(_line("Generated tokens (server / client)", f"{key['generation_tokens']:g} / {streamed[1]}"))
    finished = ", ".join(f"{reason} {count:g}" for reason, count in sorted(key["request_success"].items()))
    lines.append(_line("Finished, by reason", finished or "none"))
    lines.append(_line("Preemptions", key["num_preemptions"]))
    for name in ("time_to_first_token", "request_queue_time", "e2e_request_latency"):
        value = key.get(f"mean_{name}_ms")
        lines.append(_line(f"Mean {name.replace('_', ' ')} (ms)", math.nan if value is None else value))
    idle = server["seconds_to_idle"]
    lines.append(_line("Idle after the run", "no" if idle is None else f"yes, after {idle:.2f} s"))
    return lines


def fault_lines(faults: dict[str, Any]) -> str:
    lines = [f"{'-' * 4} Faults injected ".ljust(71, "-")]
    for name, case in faults["malformed"].items():
        statuses = ", ".join(f"{status} x{n}" for status, n in sorted(case["statuses"].items()))
        lines.append(_line(f"  {name}", f"{statuses}; error body {case['with_error_body']}/{case['sent']}"))
    aborted = faults["aborted"]
    if aborted["sent"]:
        lines.append(
            _line(
                "  aborted streams",
                f"{aborted['disconnected_mid_stream']} cut, {aborted['finished_before_the_cut']} finished first, "
                f"{aborted['failed_otherwise']} failed otherwise",
            )
        )
    return "\n".join(lines)


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: NaN becomes null, infinity the string "inf" (as vLLM's request_rate)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def save_result(path: Path, result_json: dict[str, Any], runs: Sequence[tuple[str, RunResult]]) -> Path:
    """The result JSON at `path`; beside it, one JSON line per request of every run (`*.requests.jsonl`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # allow_nan=False: a non-finite number _finite missed fails here rather than writing invalid JSON.
    path.write_text(json.dumps(_finite(result_json), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    detail = path.with_suffix(".requests.jsonl")
    with detail.open("w", encoding="utf-8") as f:
        for label, result in runs:
            for record in result.records:
                f.write(json.dumps(_finite({"run": label, **record.detail()}), allow_nan=False) + "\n")
    return detail
