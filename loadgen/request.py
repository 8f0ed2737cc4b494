"""One request against an OpenAI-compatible server, timed chunk by chunk as it streams.

The harness sends with aiohttp rather than httpx (which the client SDK uses): on this
path it spends a third of httpx's CPU per request and a quarter per chunk, and at a
thousand concurrent streams that difference is the harness's own overhead
(bench/loadgen_overhead.py measures it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from cadence.loadgen.datasets import SampleRequest
from cadence.loadgen.records import RequestRecord

Endpoint = Literal["completions", "chat"]
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Target:
    """The server, the model, and what every request asks of it."""

    base_url: str
    model: str
    endpoint: Endpoint = "completions"
    api_key: str | None = None
    ignore_eos: bool = False
    sampling: dict[str, Any] = field(default_factory=dict)  # temperature, top_p, ... and --extra-body

    @property
    def url(self) -> str:
        return self.base_url + PATHS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, sample: SampleRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": sample.prompt}]
            body["max_completion_tokens"] = sample.output_len
        else:
            body["prompt"] = sample.prompt
            body["max_tokens"] = sample.output_len
        if self.ignore_eos:
            body["ignore_eos"] = True
        body.update(self.sampling)
        return body


def _text_of(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice["text"] or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or ""


def _error_message(body: Any) -> str:
    """The message of an OpenAI-style error body (or vLLM's older flat one)."""
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(body)[:500]


class StreamReader:
    """Feeds a record from the server-sent events of one streamed answer."""

    def __init__(self, record: RequestRecord, clock: Callable[[], float]) -> None:
        self.record = record
        self.clock = clock
        self.pieces: list[str] = []
        self.buffer = b""
        self.finished = False  # [DONE] seen
        self.usage_seen = False

    def feed(self, data: bytes) -> None:
        now = self.clock()
        self.buffer += data
        *events, self.buffer = self.buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._on_data(line[5:].strip(), now)

    def _on_data(self, payload: bytes, now: float) -> None:
        if payload == b"[DONE]":
            self.finished = True
            return
        chunk = json.loads(payload)
        record = self.record
        if "error" in chunk:
            record.error = _error_message(chunk)
            record.error_body = chunk
            return
        texts = False
        for choice in chunk.get("choices") or ():
            text = _text_of(choice)
            if text:
                texts = True
                self.pieces.append(text)
            if choice.get("finish_reason"):
                record.finish_reason = choice["finish_reason"]
        if texts:
            record.token_times.append(now)
        usage = chunk.get("usage")
        if usage:
            self.usage_seen = True
            record.output_tokens = int(usage.get("completion_tokens") or 0)
            if usage.get("prompt_tokens") is not None:
                record.usage_prompt_tokens = int(usage["prompt_tokens"])

    def close(self) -> None:
        record = self.record
        record.generated_text = "".join(self.pieces)
        if not self.usage_seen:
            # No usage chunk: one token per text chunk is the best count there is.
            record.output_tokens = len(record.token_times)


async def stream_request(
    session: aiohttp.ClientSession,
    target: Target,
    sample: SampleRequest,
    record: RequestRecord,
    clock: Callable[[], float],
    abort_after: int | None = None,
) -> None:
    """Send one streamed request and fill `record`; never raises for what the server does.

    With `abort_after`, the harness closes the connection after that many text chunks,
    as a user who gives up would.
    """
    reader = StreamReader(record, clock)
    record.sent = clock()
    try:
        async with session.post(target.url, json=target.body(sample), headers=target.headers) as response:
            record.status = response.status
            if response.status != 200:
                await _read_error(response, record)
            else:
                async for data in response.content.iter_any():
                    reader.feed(data)
                    if abort_after is not None and len(record.token_times) >= abort_after:
                        record.error = f"aborted by the harness after {abort_after} chunks"
                        # Drop the connection, as a client that gives up does.
                        response.close()
                        break
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        record.error = record.error or f"{type(error).__name__}: {error}"
    except json.JSONDecodeError as error:
        record.error = f"the stream held a chunk that is not JSON: {error}"
    record.done = clock()
    reader.close()
    record.success = record.status == 200 and not record.error and (reader.finished or record.finish_reason is not None)
    if record.success is False and not record.error:
        record.error = "the stream ended without [DONE] or a finish reason"


async def _read_error(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    raw = await response.read()
    try:
        record.error_body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        record.error_body = None
    text = raw.decode("utf-8", "replace")
    record.error = f"HTTP {response.status}: {_error_message(record.error_body) if record.error_body else text[:500]}"


async def send_raw(
    session: aiohttp.ClientSession, target: Target, content: bytes, record: RequestRecord, clock: Callable[[], float]
) -> None:
    """Send a prepared body as it is (a malformed request) and record how the server answered."""
    record.sent = clock()
    headers = {**target.headers, "Content-Type": "application/json"}
    try:
        async with session.post(target.url, data=content, headers=headers) as response:
            record.status = response.status
            await _read_error(response, record)
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        record.error = f"{type(error).__name__}: {error}"
    record.done = clock()


def monotonic_clock(start: float) -> Callable[[], float]:
    """Seconds since `start` on perf_counter."""
    return lambda: time.perf_counter() - start
