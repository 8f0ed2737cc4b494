"""`cadence loadgen`'s flags. Where `vllm bench serve` has a flag of the same meaning, it has the same name."""

from __future__ import annotations

import argparse
import math
import os

from cadence.loadgen.datasets import BUILDERS


def _rate(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be positive, or inf")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError("must be between 0 and 1")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if not 0 < value < math.inf:  # every run is bounded in time
        raise argparse.ArgumentTypeError("must be a positive, finite number of seconds")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="cadence loadgen",
        description="Load-test any OpenAI-compatible server: latency from when each request was due, "
        "goodput, sweeps, capacity, the server's /metrics, fault injection and plots.",
    )
    target = ap.add_argument_group("target")
    target.add_argument("--base-url", help="the server, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=8000)
    target.add_argument(
        "--endpoint",
        default="completions",
        help="completions or chat (or their paths, /v1/completions and /v1/chat/completions)",
    )
    target.add_argument("--model", help="the model name to send (default: the server's first in /v1/models)")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")

    data = ap.add_argument_group("dataset")
    data.add_argument("--dataset-name", choices=sorted(BUILDERS), default="random")
    data.add_argument("--dataset-path", help="the ShareGPT or custom JSON/JSONL file")
    data.add_argument("--num-prompts", type=_positive_int, default=1000)
    data.add_argument("--tokenizer", help="a local tokenizer folder (default: the server's /tokenize)")
    data.add_argument("--random-input-len", type=int, default=1024)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument("--random-range-ratio", type=float, default=0.0)
    data.add_argument("--random-prefix-len", type=int, default=0)
    data.add_argument(
        "--sharegpt-output-len", type=int, help="max_tokens for every ShareGPT prompt (default: the reply's length)"
    )
    data.add_argument("--prefix-repetition-prefix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-suffix-len", type=int, default=256)
    data.add_argument("--prefix-repetition-num-prefixes", type=int, default=10)
    data.add_argument("--prefix-repetition-output-len", type=int, default=128)
    data.add_argument("--custom-output-len", type=int, default=256)

    load = ap.add_argument_group("arrivals")
    load.add_argument("--request-rate", type=_rate, default=float("inf"), help="requests per second, or inf (default)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps; 1 is Poisson")
    load.add_argument("--max-concurrency", type=_positive_int, help="at most this many requests in flight")
    load.add_argument("--num-warmups", type=int, default=0, help="requests sent first and left out of the results")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-timeout", type=_seconds, default=600.0, help="seconds per request (default 600)")
    load.add_argument("--max-duration", type=_seconds, default=3600.0, help="seconds per run before it is cut off")

    sampling = ap.add_argument_group("sampling")
    sampling.add_argument("--ignore-eos", action="store_true", help="every request generates its max_tokens")
    sampling.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    sampling.add_argument("--top-p", type=float)
    sampling.add_argument("--top-k", type=int)
    sampling.add_argument("--min-p", type=float)
    sampling.add_argument("--extra-body", help="a JSON object merged into every request body")

    slo = ap.add_argument_group("SLOs, sweeps and capacity")
    slo.add_argument(
        "--goodput", "--slo", nargs="+", default=[], metavar="KEY:MS", help="e.g. ttft:500 tpot:50 e2el:10000"
    )
    slo.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles to report (default 99)")
    slo.add_argument("--sweep", help="request-rate=1,2,4,inf or max-concurrency=1,8,32: one run per value")
    slo.add_argument("--find-capacity", action="store_true", help="search for the highest rate that meets the SLOs")
    slo.add_argument("--slo-percentile", type=float, default=90.0, help="the percentile that must meet the SLOs")
    slo.add_argument("--capacity-start-rate", type=_rate, default=1.0)
    slo.add_argument("--capacity-tolerance", type=float, default=0.1, help="stop when the bracket is this narrow")
    slo.add_argument("--capacity-max-probes", type=_positive_int, default=8)

    faults = ap.add_argument_group("fault injection")
    faults.add_argument("--abort-fraction", type=_fraction, default=0.0, help="share of streams cut mid-way")
    faults.add_argument("--malformed-fraction", type=_fraction, default=0.0, help="share of requests sent invalid")

    server = ap.add_argument_group("server metrics")
    server.add_argument("--metrics-interval", type=float, default=1.0, help="seconds between /metrics scrapes")
    server.add_argument("--no-server-metrics", action="store_true", help="do not scrape /metrics")

    out = ap.add_argument_group("output")
    out.add_argument(
        "--save-result",
        nargs="?",
        const="",
        metavar="FILE",
        help="write the result JSON (to FILE, or to --result-dir/--result-filename) and a per-request file beside it",
    )
    out.add_argument("--result-dir", default=".")
    out.add_argument("--result-filename")
    out.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR")
    out.add_argument("--disable-tqdm", action="store_true")
    return ap
