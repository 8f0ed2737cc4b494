"""Streaming completions arriving at a fixed rate (Poisson), each timed token by token.

Unlike a closed loop at fixed concurrency, arrivals do not wait for the server, so a
server that falls behind shows it in time to first token, as users would see it.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass
class TimedStream:
    kind: str  # which part of the mix it belongs to
    ttft: float  # seconds from sending to the first token
    gaps: list[float]  # seconds between successive tokens

    @property
    def mean_itl(self) -> float:
        return statistics.fmean(self.gaps) if self.gaps else 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _stream(client: httpx.AsyncClient, model: str, kind: str, prompt: list[int], max_tokens: int) -> TimedStream:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[len("data: ") :])
                if any(c.get("text") for c in chunk.get("choices") or []):
                    arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError("a stream closed without a token")
    return TimedStream(kind, arrivals[0] - sent, [b - a for a, b in zip(arrivals, arrivals[1:])])


async def _run(
    base_url: str, model: str, requests: list[tuple[str, list[int], int]], rate: float, seed: int
) -> tuple[float, list[TimedStream]]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(requests) + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.perf_counter()
        tasks = []
        for kind, prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(_stream(client, model, kind, prompt, max_tokens)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return time.perf_counter() - start, list(results)


def run_open_loop(
    base_url: str, model: str, requests: list[tuple[str, list[int], int]], rate: float, seed: int
) -> tuple[float, list[TimedStream]]:
    """Send (kind, prompt ids, max_tokens) requests at `rate` per second on average; the
    wall time until the last stream closed, and every stream's timings."""
    return asyncio.run(_run(base_url, model, requests, rate, seed))
