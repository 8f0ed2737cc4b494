"""What completions and chat share: submitting prompts, waiting, disconnects, SSE.

A handler submits one engine request per prompt into a `RequestGroup`, which wakes once
per engine step in which any of them changed. Whether the answer is streamed or not, the
group ends by aborting whatever did not finish, so a disconnect, a cancelled task or an
error frees the engine's KV blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from cadence.engine.outputs import PositionLogprobs, RequestOutput
from cadence.engine.protocol import EngineCoreRequest
from cadence.engine.sampling_params import SamplingParams
from cadence.openai_schema.requests import StreamOptions
from cadence.openai_schema.responses import (
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    Usage,
)
from cadence.server.admission import EngineOverloadedError
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.engine_process import EngineDeadError
from cadence.server.errors import APIError, bad_request, overloaded, unavailable
from cadence.server.output_fanout import RequestRejectedError
from cadence.server.prompts import Prompt
from cadence.server.request_stream import RequestStream


def new_id(prefix: str, request: Request) -> str:
    """The API call's id: its X-Request-Id (server/request_ids.py) after `prefix`."""
    request_id = getattr(request.state, "request_id", None) or uuid.uuid4().hex
    return f"{prefix}-{request_id}"


def sse(payload: BaseModel) -> str:
    """One server-sent event, exactly as OpenAI frames it; keys never set are left out
    (openai_schema/responses.py)."""
    return f"data: {payload.model_dump_json(exclude_unset=True)}\n\n"


def json_response(payload: BaseModel) -> Response:
    """A whole (not streamed) answer."""
    return Response(payload.model_dump_json(), media_type="application/json")


SSE_DONE = "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """An SSE response that always closes its event generator, however the response ends.

    Starlette cancels the response on a client disconnect; if that lands while a frame
    is being sent, the generator is left suspended at its `yield` and its `finally`
    (which aborts the engine requests) would only run when it is garbage-collected.
    """

    def __init__(self, events: AsyncGenerator[str, None], group: RequestGroup) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.events = events
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.events.aclose()
            # A generator that never started skips its own finally when closed.
            self.group.abort()


# How the engine words the grammar failures of a request the API already checked
# (engine/structured_output/manager.py, engine/engine_core.py).
_COMPILE_TIMEOUT = "did not compile within"
_LEFT_GRAMMAR = "the output left its grammar"


def _rejection(reason: str, retry_after: int) -> APIError:
    if _COMPILE_TIMEOUT in reason:
        # The API compiled this grammar in time: the engine's compile threads are busy.
        return unavailable(f"{reason} in the engine, which is busy; try again", retry_after)
    if _LEFT_GRAMMAR in reason:
        # The engine sampled a token its own mask allowed and its matcher then refused.
        return APIError(500, f"internal error: {reason}", type="server_error")
    return bad_request(reason)


def as_api_error(error: Exception, retry_after: int = 1) -> APIError:
    """The HTTP answer for an error raised while a request is in the engine; `retry_after`
    is what a 503 tells the client to wait."""
    if isinstance(error, APIError):
        return error
    if isinstance(error, EngineOverloadedError):
        return overloaded(str(error))
    if isinstance(error, EngineDeadError):
        return unavailable(str(error), retry_after)
    if isinstance(error, RequestRejectedError):
        return _rejection(str(error), retry_after)
    if isinstance(error, ValueError):
        return bad_request(str(error))
    return APIError(500, f"internal error: {error}", type="server_error")


@dataclass
class ChoiceCursor:
    """How much of one choice a stream has already sent."""

    text_sent: int = 0
    tokens_sent: int = 0
    text_offset: int = 0  # characters sent, for completions' logprobs text_offset
    started: bool = False
    finished: bool = False


@dataclass
class ChoiceDelta:
    """What a choice gained since the stream last sent it."""

    text: str
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    first: bool


def take_delta(stream: RequestStream, index: int, cursor: ChoiceCursor, with_logprobs: bool) -> ChoiceDelta | None:
    """The next piece of choice `index` worth sending, or None; advances the cursor.

    Text a stop string might still claim is held back. Tokens go out with the text they
    made, except that a caller who wants logprobs gets every token as it comes.
    """
    completion = stream.output.outputs[index]
    if cursor.finished:
        return None
    end = max(stream.streamable_text_length(index), cursor.text_sent)
    text = completion.text[cursor.text_sent : end]
    token_ids = completion.token_ids[cursor.tokens_sent :]
    if not text and not completion.finished and not (with_logprobs and token_ids):
        return None
    logprobs = None
    if with_logprobs and completion.logprobs is not None:
        logprobs = completion.logprobs[cursor.tokens_sent :]
    delta = ChoiceDelta(
        text=text,
        token_ids=token_ids,
        logprobs=logprobs,
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        first=not cursor.started,
    )
    cursor.started = True
    cursor.finished = completion.finished
    cursor.text_sent = end
    cursor.tokens_sent = len(completion.token_ids)
    return delta


class RequestGroup:
    """The engine requests behind one API call (one per prompt), woken together."""

    def __init__(self, client: AsyncEngineClient, priority: int) -> None:
        self.client = client
        self.priority = priority
        self.request_id = ""
        self.streams: list[RequestStream] = []
        self.created = int(time.time())
        self._changed = asyncio.Event()

    def submit(self, request_id: str, prompts: list[Prompt], params: list[SamplingParams]) -> None:
        """Queue every prompt, or none: a refusal part-way aborts the ones already queued."""
        self.request_id = request_id
        needed = sum(p.n for p in params)
        if needed > self.client.max_sequences:
            raise bad_request(
                f"this request needs {needed} sequences, more than this server ever holds "
                f"({self.client.max_sequences})",
                "n",
            )
        try:
            for i, (prompt, sampling) in enumerate(zip(prompts, params)):
                engine_request = EngineCoreRequest(f"{request_id}-{i}", prompt.token_ids, sampling, self.priority)
                self.streams.append(self.client.add_request(engine_request, prompt.text, self._changed))
        except Exception as error:
            self.abort()
            raise as_api_error(error, self.client.retry_after) from error

    @property
    def finished(self) -> bool:
        return all(s.output.finished for s in self.streams)

    async def wait(self) -> None:
        """Wait for the next step that changed any request; raise the first failure."""
        await self._changed.wait()
        self._changed.clear()
        for stream in self.streams:
            stream.raise_if_failed()

    async def run_to_end(self, request: Request) -> list[RequestOutput]:
        """Wait until every request finishes, aborting them all if the client goes away."""
        watcher = asyncio.create_task(wait_for_disconnect(request))
        try:
            while not self.finished:
                waiter = asyncio.create_task(self.wait())
                done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    waiter.cancel()
                    # Nobody reads this answer; 499 is what proxies log for it.
                    raise APIError(499, "the client closed the connection", type="client_closed_request")
                waiter.result()
            return [s.output for s in self.streams]
        except Exception as error:
            raise as_api_error(error) from error
        finally:
            watcher.cancel()
            self.abort()

    def abort(self) -> None:
        for stream in self.streams:
            stream.abort()

    def usage(self) -> Usage:
        prompt_tokens = sum(len(s.output.prompt_token_ids) for s in self.streams)
        completion_tokens = sum(len(c.token_ids) for s in self.streams for c in s.output.outputs)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class ChunkWriter:
    """Frames one streamed call's chunks, with usage as `stream_options` asks."""

    def __init__(
        self,
        group: RequestGroup,
        response_type: type[CompletionStreamResponse] | type[ChatCompletionStreamResponse],
        model_name: str,
        options: StreamOptions | None,
    ) -> None:
        self.group = group
        self.response_type = response_type
        # Set on every chunk, so sent (see sse()), though it is the model's default.
        self.object_type = response_type.model_fields["object"].default
        self.model_name = model_name
        self.include_usage = options is not None and options.include_usage
        # vLLM's rule: usage on every chunk only when usage was asked for at all.
        self.continuous_usage = self.include_usage and options is not None and options.continuous_usage_stats

    def chunk(
        self, choices: Sequence[CompletionStreamChoice] | Sequence[ChatStreamChoice], usage: Usage | None = None
    ) -> str:
        fields: dict[str, Any] = {
            "id": self.group.request_id,
            "object": self.object_type,
            "created": self.group.created,
            "model": self.model_name,
            "choices": choices,
        }
        # Usage is set (so sent, null or not) only when the call asked for it.
        if self.include_usage:
            fields["usage"] = self.group.usage() if self.continuous_usage else usage
        return sse(self.response_type(**fields))

    def finish(self) -> list[str]:
        """The final usage chunk (no choices), when usage was asked for."""
        return [self.chunk([], self.group.usage())] if self.include_usage else []


async def wait_for_disconnect(request: Request) -> None:
    """Return once the client has closed the connection."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def stream_events(
    group: RequestGroup, on_update: Callable[[], list[str]], on_finish: Callable[[], list[str]]
) -> AsyncGenerator[str, None]:
    """SSE frames for a group: `on_update` after each step, `on_finish` at the end.

    `finished` is read before the frames are built: a yield may suspend this generator
    (a slow client), and a request that finishes meanwhile must still get its last
    frames. An error part-way is sent as an error event before [DONE].
    """
    try:
        while True:
            finished = group.finished
            for frame in on_update():
                yield frame
            if finished:
                break
            try:
                await group.wait()
            except Exception as error:  # noqa: BLE001 - reported to the client in-band
                yield as_api_error(error).sse_event()
                yield SSE_DONE
                return
        for frame in on_finish():
            yield frame
        yield SSE_DONE
    finally:
        group.abort()
