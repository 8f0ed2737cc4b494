"""What `cadence loadgen` adds to the latencies it reports, at up to 1,000 concurrent streams.

The target is tests/synthetic_server.py in its own process on loopback: every answer's
first chunk leaves `--ttft` seconds after the server read the request and each further
chunk `--itl` later, so the true latencies are known. Requests arrive as a Poisson process
at the rate that keeps `--streams` of them in flight (Little's law: streams over the true
end-to-end latency), for `--seconds` of arrivals. Whatever the harness reports beyond the
true timeline is what it, the kernel's loopback and the server's lateness added; the
server measures its own lateness, shown apart.

    python bench/loadgen_overhead.py                          # 10, 100 and 1,000 streams
    python bench/loadgen_overhead.py --streams 1000 --tokens 32 --itl 0.05   # 8x the request churn
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics

from cadence.loadgen.datasets import SampleRequest
from cadence.loadgen.records import RunSettings
from cadence.loadgen.request import Target
from cadence.loadgen.run import RunOptions, run_load
from cadence.loadgen.stats import percentile, summarize
from common.from_tests import SyntheticServerProcess
from common.machine import Contention, machine_info, machine_line


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(args: argparse.Namespace, server: SyntheticServerProcess, streams: int) -> dict[str, float]:
    tokens, ttft, itl = args.tokens, args.ttft, args.itl
    true_e2el = ttft + (tokens - 1) * itl
    rate = streams / true_e2el
    count = max(streams, round(rate * args.seconds))
    samples = [SampleRequest("x", 1, tokens) for _ in range(count)]
    settings = RunSettings(rate, 1.0, None, count)
    options = RunOptions(scrape_metrics=False, progress=False, request_timeout=120.0, max_duration=600.0)
    server_before = len(server.lateness())
    server_cpu = cpu_seconds(server.process.pid)
    own = os.times()
    with Contention() as contention:
        result, _ = asyncio.run(run_load(Target(server.base_url, "synthetic"), samples, settings, options))
    server_cores = (cpu_seconds(server.process.pid) - server_cpu) / max(result.duration, 1e-9)
    after = os.times()
    harness_cores = (after.user + after.system - own.user - own.system) / max(result.duration, 1e-9)
    lateness = server.lateness()[server_before:]
    summary = summarize(result)
    if summary["completed"] != count or summary["total_output_tokens"] != count * tokens:
        raise RuntimeError(f"{summary['completed']} of {count} streams completed: {summary['errors'][:3]}")
    e2els = [r.e2el for r in result.succeeded]
    return {
        "streams": streams,
        "peak_streams": summary["max_concurrent_requests"],
        "requests": count,
        "chunks_per_s": count * tokens / result.duration,
        "ttft_added_ms": (summary["mean_ttft_ms"] - ttft * 1000.0),
        "ttft_added_pct": (summary["mean_ttft_ms"] / (ttft * 1000.0) - 1.0) * 100.0,
        "p99_ttft_added_pct": (summary["p99_ttft_ms"] / (ttft * 1000.0) - 1.0) * 100.0,
        "itl_added_ms": summary["mean_itl_ms"] - itl * 1000.0,
        "e2el_added_pct": (statistics.fmean(e2els) / true_e2el - 1.0) * 100.0,
        "p99_e2el_added_pct": (percentile(e2els, 99) / true_e2el - 1.0) * 100.0,
        "server_late_ms": statistics.fmean(lateness) * 1000.0,
        "server_late_p99_ms": percentile(lateness, 99) * 1000.0,
        "loop_lag_p99_ms": summary["p99_harness_loop_lag_ms"],
        "send_delay_p99_ms": summary["p99_send_delay_ms"],
        "server_cores": server_cores,
        "harness_cores": harness_cores,
        "other_cores": max(0.0, contention.other_cores - server_cores),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, nargs="+", default=[10, 100, 1000], help="streams in flight")
    ap.add_argument("--seconds", type=float, default=30.0, help="seconds of arrivals per row")
    # A loaded server's stream: a second to the first token, then 10 tokens a second.
    ap.add_argument("--tokens", type=int, default=128, help="chunks per stream")
    ap.add_argument("--ttft", type=float, default=1.0)
    ap.add_argument("--itl", type=float, default=0.1)
    args = ap.parse_args()
    print(machine_line(machine_info()))
    print(
        f"synthetic answers: TTFT {args.ttft * 1000:g} ms, then {args.tokens - 1} chunks {args.itl * 1000:g} ms apart"
    )
    with SyntheticServerProcess(args.ttft, args.itl) as server:
        rows = [measure(args, server, n) for n in args.streams]
    print(
        "| streams (peak) | requests | chunks/s | TTFT added (mean / p99) | ITL added | E2EL added (mean / p99) "
        "| server late (mean / p99) | harness loop lag p99 | send delay p99 "
        "| harness cores | server cores | other cores |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['streams']} ({r['peak_streams']}) | {r['requests']} | {r['chunks_per_s']:,.0f} "
            f"| {r['ttft_added_ms']:.1f} ms ({r['ttft_added_pct']:.2f}% / {r['p99_ttft_added_pct']:.2f}%) "
            f"| {r['itl_added_ms']:.2f} ms | {r['e2el_added_pct']:.2f}% / {r['p99_e2el_added_pct']:.2f}% "
            f"| {r['server_late_ms']:.1f} / {r['server_late_p99_ms']:.1f} ms | {r['loop_lag_p99_ms']:.1f} ms "
            f"| {r['send_delay_p99_ms']:.1f} ms | {r['harness_cores']:.2f} | {r['server_cores']:.2f} "
            f"| {r['other_cores']:.2f} |"
        )


if __name__ == "__main__":
    main()
