"""One request against an OpenAI-compatible server, timed chunk by chunk as it streams.

The harness sends with aiohttp rather than httpx (which the client SDK uses): on this
path it spends under half of httpx's CPU per request and a quarter per chunk, and at a
thousand concurrent streams that difference is the harness's own overhead
(bench/loadgen_overhead.py measures it).
"""

from __future__ import annotations

import asyncio
import json
import time
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
    """Keeps what one streamed answer delivered, and when; reads it into the record later.

    While the run goes on, a read costs a clock call and an append: parsing the events
    waits for `finish()`, after the run, so that it cannot delay other streams' timings.
    """

    def __init__(self, record: RequestRecord, start: float) -> None:
        self.record = record
        self.start = start  # the run's perf_counter origin
        self.reads: list[tuple[float, bytes]] = []
        self.events = 0  # events completed so far (approximately: blank lines seen)
        self.finished = False  # [DONE] seen
        self.usage_seen = False

    def feed(self, data: bytes) -> None:
        self.reads.append((time.perf_counter(), data))
        # Events end in a blank line: "\n\n", or "\r\n\r\n" from servers on sse-starlette.
        self.events += data.count(b"\n\n") + data.count(b"\r\n\r\n")

    def finish(self) -> None:
        """Read every event into the record, and judge whether the answer succeeded."""
        record = self.record
        pieces: list[str] = []
        buffer = b""
        try:
            for arrived, data in self.reads:
                # SSE lines may end in CRLF; a CR left at the end waits in the buffer for its LF.
                buffer = (buffer + data).replace(b"\r\n", b"\n")
                *events, buffer = buffer.split(b"\n\n")
                for event in events:
                    for line in event.split(b"\n"):
                        if line.startswith(b"data:"):
                            self._on_data(line[5:].strip(), arrived - self.start, pieces)
        except json.JSONDecodeError as error:
            record.error = record.error or f"the stream held a chunk that is not JSON: {error}"
        except (TypeError, AttributeError, ValueError) as error:
            # JSON of another shape (a list, a string, a field of the wrong type): this
            # request failed; the run, which reads every stream after it ends, goes on.
            record.error = record.error or f"the stream held a chunk of another shape: {type(error).__name__}: {error}"
        self.reads = []
        record.generated_text = "".join(pieces)
        if not self.usage_seen:
            # No usage chunk: one token per text chunk is the best count there is.
            record.output_tokens = len(record.token_times)
        complete = self.finished or record.finish_reason is not None
        record.success = record.status == 200 and not record.error and complete
        if record.status == 200 and not record.error and not complete:
            record.error = "the stream ended without [DONE] or a finish reason"

    def _on_data(self, payload: bytes, now: float, pieces: list[str]) -> None:
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
                pieces.append(text)
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


async def stream_request(
    session: aiohttp.ClientSession,
    target: Target,
    sample: SampleRequest,
    reader: StreamReader,
    abort_after: int | None = None,
) -> None:
    """Send one streamed request into `reader`; never raises for what the server does. Call
    `reader.finish()` after the run to fill in its record: the caller keeps the reader, so
    what a request cancelled at the run's deadline had received is still read.

    Times are seconds since the reader's `start` (a perf_counter reading). With
    `abort_after`, the harness closes the connection after that many events, as a user who
    gives up would.
    """
    record, start = reader.record, reader.start
    record.sent = time.perf_counter() - start
    try:
        async with session.post(target.url, json=target.body(sample), headers=target.headers) as response:
            record.status = response.status
            if response.status != 200:
                await _read_error(response, record)
            else:
                async for data in response.content.iter_any():
                    reader.feed(data)
                    if abort_after is not None and reader.events >= abort_after:
                        record.error = f"aborted by the harness after {abort_after} chunks"
                        # Drop the connection, as a client that gives up does.
                        response.close()
                        break
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        record.error = record.error or f"{type(error).__name__}: {error}"
    record.done = time.perf_counter() - start


async def _read_error(response: aiohttp.ClientResponse, record: RequestRecord) -> None:
    raw = await response.read()
    try:
        record.error_body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        record.error_body = None
    text = raw.decode("utf-8", "replace")
    record.error = f"HTTP {response.status}: {_error_message(record.error_body) if record.error_body else text[:500]}"


async def send_raw(
    session: aiohttp.ClientSession, target: Target, content: bytes, record: RequestRecord, start: float
) -> None:
    """Send a prepared body as it is (a malformed request) and record how the server answered."""
    record.sent = time.perf_counter() - start
    headers = {**target.headers, "Content-Type": "application/json"}
    try:
        async with session.post(target.url, data=content, headers=headers) as response:
            record.status = response.status
            await _read_error(response, record)
    except (aiohttp.ClientError, asyncio.TimeoutError) as error:
        record.error = f"{type(error).__name__}: {error}"
    record.done = time.perf_counter() - start
