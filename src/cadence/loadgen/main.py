"""`cadence loadgen`: from the flags to runs, tables, result files and plots."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from cadence.client import CadenceError
from cadence.loadgen.cli import build_parser
from cadence.loadgen.datasets import DatasetOptions, SampleRequest, build_dataset
from cadence.loadgen.faults import fault_report, malformed_cases
from cadence.loadgen.records import RunResult, RunSettings
from cadence.loadgen.report import fault_lines, save_result, summary_table
from cadence.loadgen.request import PATHS, Endpoint, Target
from cadence.loadgen.run import RunOptions, run_load
from cadence.loadgen.stats import SLO, summarize
from cadence.loadgen.sweep import CapacitySearch, SweepSpec, find_capacity, run_sweep
from cadence.loadgen.tokenizer import LocalTokenizer, ServerTokenizer, TokenCounter

ENDPOINTS: dict[str, Endpoint] = {
    "completions": "completions",
    "/v1/completions": "completions",
    "chat": "chat",
    "/v1/chat/completions": "chat",
}


def base_url_of(args: argparse.Namespace) -> str:
    url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return url.removesuffix("/v1")


def served_model(base_url: str, headers: dict[str, str]) -> tuple[str, int | None]:
    """The first model the server lists, and its context length where the server says it."""
    response = httpx.get(f"{base_url}/v1/models", headers=headers, timeout=30.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"]), models[0].get("max_model_len")


def sampling_of(args: argparse.Namespace) -> dict[str, Any]:
    sampling: dict[str, Any] = {"temperature": args.temperature}
    for name in ("top_p", "top_k", "min_p"):
        if getattr(args, name) is not None:
            sampling[name] = getattr(args, name)
    if args.extra_body:
        extra = json.loads(args.extra_body)
        if not isinstance(extra, dict):
            raise ValueError("--extra-body must be a JSON object")
        sampling.update(extra)
    return sampling


class Loadgen:
    """Everything one invocation needs to make runs: the target, the datasets, the options."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        if args.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint is one of {', '.join(ENDPOINTS)}, not {args.endpoint!r}")
        base_url = base_url_of(args)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        listed, max_model_len = served_model(base_url, headers)
        model = args.model or listed
        self.target = Target(
            base_url, model, ENDPOINTS[args.endpoint], args.api_key, args.ignore_eos, sampling_of(args)
        )
        self.tokenizer: TokenCounter = (
            LocalTokenizer(args.tokenizer) if args.tokenizer else ServerTokenizer(base_url, model, args.api_key)
        )
        self.slo = SLO.parse(args.goodput) if args.goodput else None
        self.percentiles = [float(q) for q in args.metric_percentiles.split(",") if q.strip()]
        if args.find_capacity and args.slo_percentile not in self.percentiles:
            # The search judges each probe by this percentile, so every summary needs it.
            self.percentiles.append(args.slo_percentile)
        self.max_model_len = max_model_len
        self.options = RunOptions(
            seed=args.seed,
            num_warmups=args.num_warmups,
            abort_fraction=args.abort_fraction,
            malformed_fraction=args.malformed_fraction,
            request_timeout=args.request_timeout,
            max_duration=args.max_duration,
            metrics_interval=args.metrics_interval,
            scrape_metrics=not args.no_server_metrics,
            progress=not args.disable_tqdm,
        )
        self.runs: list[tuple[str, RunResult]] = []

    def samples(self, index: int) -> list[SampleRequest]:
        """A fresh prompt set per run, so no run hits a prefix cache another one warmed."""
        a = self.args
        options = DatasetOptions(
            name=a.dataset_name,
            num_prompts=a.num_prompts,
            seed=a.seed + index,
            path=a.dataset_path,
            random_input_len=a.random_input_len,
            random_output_len=a.random_output_len,
            random_range_ratio=a.random_range_ratio,
            random_prefix_len=a.random_prefix_len,
            sharegpt_output_len=a.sharegpt_output_len,
            prefix_repetition_prefix_len=a.prefix_repetition_prefix_len,
            prefix_repetition_suffix_len=a.prefix_repetition_suffix_len,
            prefix_repetition_num_prefixes=a.prefix_repetition_num_prefixes,
            prefix_repetition_output_len=a.prefix_repetition_output_len,
            custom_output_len=a.custom_output_len,
            max_model_len=self.max_model_len,
        )
        return build_dataset(self.tokenizer, options)

    async def run(self, label: str, index: int, rate: float, concurrency: int | None) -> dict[str, Any]:
        """One run; prints its table and returns its summary (server and fault reports included)."""
        settings = RunSettings(rate, self.args.burstiness, concurrency, self.args.num_prompts)
        options = dataclasses.replace(self.options, seed=self.args.seed + index)
        result, scraper = await run_load(self.target, self.samples(index), settings, options)
        server = scraper.report() if scraper is not None else None
        result.server = server
        summary = summarize(result, self.percentiles, self.slo)
        summary["server_metrics"] = server
        print(f"\n[{label}] {settings.label()}")
        print(summary_table(summary, self.percentiles, server))
        if options.abort_fraction or options.malformed_fraction:
            summary["faults"] = fault_report(result.records, malformed_cases(self.target))
            print(fault_lines(summary["faults"]))
        self.runs.append((label, result))
        return summary

    def header(self) -> dict[str, Any]:
        return {
            "date": time.strftime("%Y%m%d-%H%M%S"),
            "backend": "openai-chat" if self.target.endpoint == "chat" else "openai",
            "base_url": self.target.base_url,
            "endpoint": PATHS[self.target.endpoint],
            "model_id": self.target.model,
            "tokenizer_id": self.args.tokenizer or f"{self.target.base_url}/tokenize",
            "dataset_name": self.args.dataset_name,
            "seed": self.args.seed,
        }


async def _main(args: argparse.Namespace) -> int:
    gen = Loadgen(args)
    slo_ms = gen.slo.limits_ms if gen.slo else None
    result_json = gen.header()
    points: list[tuple[float, dict[str, Any]]] = []
    axis = "request-rate"
    if args.find_capacity:
        if gen.slo is None:
            raise ValueError("--find-capacity needs SLOs: --goodput ttft:MS tpot:MS ...")
        search = CapacitySearch(
            gen.slo, args.slo_percentile, args.capacity_start_rate, args.capacity_tolerance, args.capacity_max_probes
        )
        capacity, points = await find_capacity(
            search, lambda rate, i: gen.run(f"probe {i + 1}", i, rate, args.max_concurrency)
        )
        # Without a failing probe the search never found the limit: the capacity is at least this.
        bounded = any(not search.passes(summary) for _, summary in points)
        result_json["capacity"] = {
            "request_rate": capacity,
            "upper_bound_found": bounded,
            "slo_ms": slo_ms,
            "at_percentile": args.slo_percentile,
        }
        found = "none found" if capacity is None else f"{'' if bounded else 'at least '}{capacity:.3g} req/s"
        print(f"\nCapacity: {found} (p{args.slo_percentile:g} within {slo_ms} ms, no failures)")
    elif args.sweep:
        spec = SweepSpec.parse(args.sweep)
        axis = spec.axis

        async def probe(value: float, i: int) -> dict[str, Any]:
            if spec.axis == "request-rate":
                return await gen.run(f"{axis}={value:g}", i, value, args.max_concurrency)
            return await gen.run(f"{axis}={value:g}", i, args.request_rate, int(value))

        points = await run_sweep(spec, probe)
    else:
        result_json.update(await gen.run("run", 0, args.request_rate, args.max_concurrency))
    if points:
        result_json["sweep"] = {"axis": axis, "points": [{"value": v, **s} for v, s in points]}
    if args.save_result is not None:
        path = Path(args.save_result) if args.save_result else _default_result_path(args, gen)
        detail = save_result(path, result_json, gen.runs)
        print(f"Saved {path} and {detail}")
    if args.plot:
        _plots(Path(args.plot), gen, points, axis, slo_ms)
    completed = sum(1 for _, r in gen.runs for rec in r.succeeded)
    return 0 if completed else 1


def _default_result_path(args: argparse.Namespace, gen: Loadgen) -> Path:
    if args.result_filename:
        return Path(args.result_dir) / args.result_filename
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}"
    name = f"cadence-loadgen-{rate}qps-{gen.target.model.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    return Path(args.result_dir) / name


def _plots(out_dir: Path, gen: Loadgen, points: list[tuple[float, dict[str, Any]]], axis: str, slo_ms: Any) -> None:
    from cadence.loadgen.plots import plot_run, plot_sweep

    written = []
    for label, result in gen.runs:
        written += plot_run(result, out_dir, label.replace(" ", "-").replace("=", "-"), slo_ms)
    if len(points) > 1:
        name = "capacity" if gen.args.find_capacity else "sweep"
        written.append(plot_sweep(points, axis, out_dir, name, slo_ms))
    print("Plots: " + ", ".join(str(p) for p in written))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return asyncio.run(_main(args))
    except (ValueError, RuntimeError, httpx.HTTPError, CadenceError, OSError) as error:
        print(f"cadence loadgen: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
