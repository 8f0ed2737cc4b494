"""Streaming chat completions at a fixed concurrency against any OpenAI-compatible server.

Each request body is sent as given (the caller sets `stream`, `max_tokens`, a
`response_format` or `ignore_eos`); the client records when its first content arrived,
when the stream closed, the usage chunk's token count and the finish reason.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass
class ChatResult:
    text: str
    ttft: float  # seconds from sending the request to its first content
    seconds: float  # seconds from sending the request to the end of its stream
    completion_tokens: int
    finish_reason: str | None

    @property
    def inter_token_seconds(self) -> float | None:
        """Mean seconds between this stream's tokens after the first; None with one token."""
        if self.completion_tokens < 2:
            return None
        return (self.seconds - self.ttft) / (self.completion_tokens - 1)


@dataclass
class ChatRun:
    seconds: float  # from the first request sent to the last stream closed
    results: list[ChatResult]

    @property
    def output_tokens(self) -> int:
        return sum(r.completion_tokens for r in self.results)

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def ttft_quantile(self, q: float) -> float:
        ordered = sorted(r.ttft for r in self.results)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    @property
    def inter_token_ms(self) -> float:
        """Mean over streams of each stream's mean gap between tokens, in ms."""
        gaps = [g for r in self.results if (g := r.inter_token_seconds) is not None]
        return 1000 * statistics.fmean(gaps) if gaps else float("nan")


async def _one_chat(client: httpx.AsyncClient, body: dict[str, Any], gate: asyncio.Semaphore) -> ChatResult:
    async with gate:
        sent = time.perf_counter()
        ttft, pieces, usage, finish = None, [], None, None
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                raise RuntimeError(f"HTTP {response.status_code}: {response.text[:500]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: ") :])
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or []:
                    content = (choice.get("delta") or {}).get("content")
                    if content:
                        ttft = ttft if ttft is not None else time.perf_counter() - sent
                        pieces.append(content)
                    finish = choice.get("finish_reason") or finish
        seconds = time.perf_counter() - sent
    if usage is None:
        raise RuntimeError("the stream sent no usage chunk (stream_options.include_usage)")
    return ChatResult(
        "".join(pieces), ttft if ttft is not None else seconds, seconds, int(usage["completion_tokens"]), finish
    )


async def _run(base_url: str, bodies: list[dict[str, Any]], concurrency: int) -> ChatRun:
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(1800.0), limits=limits) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(_one_chat(client, body, gate) for body in bodies))
        return ChatRun(time.perf_counter() - start, list(results))


def run_chat(base_url: str, bodies: list[dict[str, Any]], concurrency: int) -> ChatRun:
    """Every body streamed from /v1/chat/completions with at most `concurrency` in flight."""
    return asyncio.run(_run(base_url, bodies, concurrency))


def stream_body(model: str, messages: list[dict[str, str]], max_tokens: int, **fields: Any) -> dict[str, Any]:
    """A greedy streaming chat request that reports usage; `fields` adds response_format, ignore_eos, ..."""
    return {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **fields,
    }
