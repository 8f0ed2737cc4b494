"""Streaming completions at a fixed concurrency against any OpenAI-compatible server.

Every request asks for `max_tokens` tokens with `ignore_eos`, so each one must stream
exactly that many; the count comes from the stream's usage chunk where the server sends
one, otherwise from the chunks (one token each when no usage is sent).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass

import httpx


@dataclass
class StreamResult:
    ttft: float  # seconds from sending the request to its first streamed token
    output_tokens: int
    chunks: int
    prompt_tokens: int | None  # as the server's usage reports it, where it sends one
    from_usage: bool  # output_tokens is the usage chunk's count, not the chunks'


@dataclass
class LoadRun:
    concurrency: int
    seconds: float  # wall time from the first request sent to the last stream closed
    results: list[StreamResult]
    other_cores: float = 0.0  # cores busy meanwhile outside the load generator and the server measured

    @property
    def output_tokens(self) -> int:
        return sum(r.output_tokens for r in self.results)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def counted_from(self) -> str:
        """Where the token counts came from: the servers' usage chunks, or the number of chunks."""
        return "usage" if all(r.from_usage for r in self.results) else "chunks"

    @property
    def ttft_p50(self) -> float:
        return statistics.median(r.ttft for r in self.results)

    def check(self, prompt_len: int, max_tokens: int) -> None:
        """Every stream gave exactly `max_tokens` tokens (and saw `prompt_len` prompt tokens, where reported)."""
        wrong = [r for r in self.results if r.output_tokens != max_tokens]
        if wrong:
            counts = sorted({r.output_tokens for r in wrong})
            raise RuntimeError(f"{len(wrong)} streams did not give {max_tokens} tokens (gave {counts})")
        seen = {r.prompt_tokens for r in self.results if r.prompt_tokens is not None}
        if seen - {prompt_len}:
            raise RuntimeError(f"the server counted {sorted(seen)} prompt tokens, not {prompt_len}")


async def _one_stream(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, gate: asyncio.Semaphore
) -> StreamResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with gate:
        sent = time.perf_counter()
        ttft, chunks, usage = None, 0, None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(c.get("text") for c in chunk.get("choices") or []):
                    chunks += 1
                    if ttft is None:
                        ttft = time.perf_counter() - sent
    if ttft is None:
        raise RuntimeError("a stream closed without a token")
    tokens = int(usage["completion_tokens"]) if usage else chunks
    prompt_tokens = int(usage["prompt_tokens"]) if usage and "prompt_tokens" in usage else None
    return StreamResult(ttft, tokens, chunks, prompt_tokens, usage is not None)


async def _run(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> LoadRun:
    gate = asyncio.Semaphore(concurrency)
    # A connection per request: llama-server may close a kept-alive connection just as the next
    # request goes out on it, which fails that request; a fresh loopback connection costs little.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one_stream(client, model, p, max_tokens, gate) for p in prompts))
        return LoadRun(concurrency, time.perf_counter() - start, list(results))


def run_load(base_url: str, model: str, prompts: list[list[int]], max_tokens: int, concurrency: int) -> LoadRun:
    """All `prompts` streamed with at most `concurrency` in flight; times the whole run."""
    return asyncio.run(_run(base_url, model, prompts, max_tokens, concurrency))
