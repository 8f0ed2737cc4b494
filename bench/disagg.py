"""Colocated against prefill/decode-disaggregated serving of the default model, same cores.

Servers, one at a time: `cadence serve` (colocated: one engine on every core) and
`cadence serve --prefill-workers 1 --decode-workers 1` (two engines, each pinned to half
the cores) with each `--prefill-placement`: remote (always disaggregate), local (never)
and cost (the router's cost model). Each gets the same mixed open-loop workload at each rate: long prompts with
short outputs (the prefill-heavy part) and short prompts with long outputs (the part
whose token stream a long prefill stalls), random token ids, arriving as a Poisson
process. Reported per rate: TTFT and inter-token latency (ITL) at p50 and p99, the
short-prompt streams' ITL p99 (what disaggregation is for), goodput under the stated
SLO, and the KV transfer's share of the long prompts' TTFT (from the server's metrics).

    python bench/disagg.py                        # rates 0.1 0.2 0.4 requests/s
    python bench/disagg.py --rates 0.2 --num-requests 16

Run it with the PYTHONPATH that makes `import cadence` the checkout to measure.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
from dataclasses import dataclass

import httpx

from common.machine import Contention, machine_info, machine_line
from common.open_loop import TimedStream, percentile, run_open_loop
from common.served_engine import EngineSpec, ServedEngine

DISAGGREGATED = ["--prefill-workers", "1", "--decode-workers", "1"]
CONFIGS = {
    "colocated": [],
    "always": [*DISAGGREGATED, "--prefill-placement", "remote"],
    "never": [*DISAGGREGATED, "--prefill-placement", "local"],
    "cost": [*DISAGGREGATED, "--prefill-placement", "cost"],
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rates", type=float, nargs="+", default=[0.1, 0.2, 0.4], help="requests per second")
    ap.add_argument("--num-requests", type=int, default=24, help="per rate, half of each kind")
    ap.add_argument("--long-prompt", type=int, default=1536, help="prompt tokens of the prefill-heavy kind")
    ap.add_argument("--long-output", type=int, default=16, help="its output tokens")
    ap.add_argument("--short-prompt", type=int, default=32, help="prompt tokens of the decode-heavy kind")
    ap.add_argument("--short-output", type=int, default=128, help="its output tokens")
    ap.add_argument("--ttft-slo", type=float, default=4.0, help="seconds; goodput counts requests within both SLOs")
    ap.add_argument("--itl-slo", type=float, default=0.25, help="seconds, a request's mean inter-token latency")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--configs",
        nargs="+",
        choices=list(CONFIGS),
        default=list(CONFIGS),
        help="colocated: one engine; the others 1P+1D, with --prefill-placement remote (always), local (never) or cost",
    )
    ap.add_argument("--max-local-prefill-stall", type=float, default=None, help="the cost configuration's limit")
    return ap.parse_args(argv)


@dataclass
class RateRun:
    rate: float
    seconds: float
    streams: list[TimedStream]
    transfer_seconds: float  # mean seconds per KV transfer during the run (0 when none)
    transfers: int
    other_cores: float

    def of(self, kind: str) -> list[TimedStream]:
        return [s for s in self.streams if s.kind == kind]

    def goodput(self, ttft_slo: float, itl_slo: float) -> float:
        good = [s for s in self.streams if s.ttft <= ttft_slo and s.mean_itl <= itl_slo]
        return len(good) / self.seconds


def workload(args: argparse.Namespace, rate: float) -> list[tuple[str, list[int], int]]:
    """The run's requests in arrival order; ids of ordinary tokens, fresh per rate."""
    rng = random.Random(f"{args.seed}-{rate}")
    requests = []
    for index in range(args.num_requests):
        long = index % 2 == 0
        length = args.long_prompt if long else args.short_prompt
        prompt = [rng.randrange(200, 40000) for _ in range(length)]
        requests.append(
            ("long prompt", prompt, args.long_output) if long else ("long output", prompt, args.short_output)
        )
    rng.shuffle(requests)
    return requests


def transfer_totals(base_url: str) -> tuple[float, float]:
    """(seconds, count) of the server's KV transfer histogram so far; zeros when it has none."""
    totals = {"cadence:kv_transfer_seconds_sum": 0.0, "cadence:kv_transfer_seconds_count": 0.0}
    for line in httpx.get(f"{base_url}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return totals["cadence:kv_transfer_seconds_sum"], totals["cadence:kv_transfer_seconds_count"]


def configs(args: argparse.Namespace) -> dict[str, list[str]]:
    """Each chosen server's flags."""
    chosen = {name: list(CONFIGS[name]) for name in args.configs}
    if "cost" in chosen and args.max_local_prefill_stall is not None:
        chosen["cost"] += ["--max-local-prefill-stall", str(args.max_local_prefill_stall)]
    return chosen


def measure(config: str, flags: list[str], args: argparse.Namespace) -> list[RateRun]:
    command = [sys.executable, "-P", "-m", "cadence.server.cli", "serve", "--port", "{port}", "--max-model-len", "2048"]
    spec = EngineSpec(config, command + flags, env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    runs = []
    with ServedEngine(spec) as server:
        print(f"{config}: started in {server.startup_seconds:.0f} s", flush=True)
        # One request of each kind first, so no run pays for first-use costs.
        run_open_loop(server.base_url, server.model_name, workload(args, -1.0)[:2], 10.0, args.seed)
        for rate in args.rates:
            before = transfer_totals(server.base_url)
            server_cpu = server.cpu_seconds()
            with Contention() as contention:
                seconds, streams = run_open_loop(
                    server.base_url, server.model_name, workload(args, rate), rate, args.seed
                )
            after = transfer_totals(server.base_url)
            count = after[1] - before[1]
            run = RateRun(rate, seconds, streams, (after[0] - before[0]) / count if count else 0.0, int(count), 0.0)
            run.other_cores = max(0.0, contention.other_cores - (server.cpu_seconds() - server_cpu) / seconds)
            runs.append(run)
            print(f"  rate {rate:g}/s: {summary(run, args)}", flush=True)
    return runs


def summary(run: RateRun, args: argparse.Namespace) -> str:
    ttfts = [s.ttft for s in run.streams]
    gaps = [g for s in run.streams for g in s.gaps]
    short_gaps = [g for s in run.of("long output") for g in s.gaps]
    return (
        f"TTFT p50 {statistics.median(ttfts):.2f} s p99 {percentile(ttfts, 0.99):.2f} s, "
        f"ITL p50 {statistics.median(gaps) * 1000:.0f} ms p99 {percentile(gaps, 0.99) * 1000:.0f} ms, "
        f"long-output ITL p99 {percentile(short_gaps, 0.99) * 1000:.0f} ms, "
        f"goodput {run.goodput(args.ttft_slo, args.itl_slo):.3f} req/s, "
        f"{run.transfers} transfers ({run.seconds:.0f} s; other processes used {run.other_cores:.2f} cores)"
    )


def report(results: dict[str, list[RateRun]], args: argparse.Namespace) -> None:
    print()
    print(
        f"Workload: {args.num_requests} requests per rate, half {args.long_prompt}-token prompts with "
        f"{args.long_output} output tokens, half {args.short_prompt}-token prompts with {args.short_output}; "
        f"SLO: TTFT <= {args.ttft_slo:g} s and mean ITL <= {args.itl_slo:g} s."
    )
    print()
    print(
        "| rate | config | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | long-output ITL p99 | goodput | "
        "transfer / long-prompt TTFT |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for index, rate in enumerate(args.rates):
        for config, runs in results.items():
            run = runs[index]
            ttfts = [s.ttft for s in run.streams]
            gaps = [g for s in run.streams for g in s.gaps]
            short_gaps = [g for s in run.of("long output") for g in s.gaps]
            long_ttft = statistics.fmean(s.ttft for s in run.of("long prompt"))
            share = f"{run.transfer_seconds / long_ttft:.1%}" if run.transfers else "-"
            print(
                f"| {rate:g}/s | {config} | {statistics.median(ttfts):.2f} s | {percentile(ttfts, 0.99):.2f} s | "
                f"{statistics.median(gaps) * 1000:.0f} ms | {percentile(gaps, 0.99) * 1000:.0f} ms | "
                f"{percentile(short_gaps, 0.99) * 1000:.0f} ms | {run.goodput(args.ttft_slo, args.itl_slo):.3f}/s | "
                f"{share} |"
            )
    print()
    base_name = "colocated" if "colocated" in results else args.configs[0]
    base = results[base_name]
    for config, runs in results.items():
        if runs is base:
            continue
        for index, rate in enumerate(args.rates):
            short_base = percentile([g for s in base[index].of("long output") for g in s.gaps], 0.99)
            short_other = percentile([g for s in runs[index].of("long output") for g in s.gaps], 0.99)
            ttft_base = statistics.median(s.ttft for s in base[index].streams)
            ttft_other = statistics.median(s.ttft for s in runs[index].streams)
            goodput_base = base[index].goodput(args.ttft_slo, args.itl_slo)
            goodput_other = runs[index].goodput(args.ttft_slo, args.itl_slo)
            print(
                f"rate {rate:g}/s, {config} against {base_name}: "
                f"long-output ITL p99 x{short_base / short_other:.2f} better, TTFT p50 x{ttft_other / ttft_base:.2f}, "
                f"goodput {goodput_other:.3f} vs {goodput_base:.3f}/s"
            )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(machine_line(machine_info()), flush=True)
    results = {config: measure(config, flags, args) for config, flags in configs(args).items()}
    report(results, args)


if __name__ == "__main__":
    main()
