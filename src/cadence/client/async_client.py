"""`AsyncClient`: the asyncio client; the calls of `Client`, awaited."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import TypeVar

import httpx
from pydantic import BaseModel
from typing_extensions import Unpack

from cadence.client import calls, params
from cadence.client.calls import Call, Request, StreamCall
from cadence.client.errors import CadenceError, ServiceUnavailableError, error_from_response, transport_errors
from cadence.client.metrics import MetricSample
from cadence.client.sse import AsyncChunkStream
from cadence.openai_schema import responses as api

R = TypeVar("R")
T = TypeVar("T", bound=BaseModel)


class AsyncClient:
    """The asyncio twin of `Client` (cadence/client/sync_client.py), whose docstrings say
    what each call does; streams are read with `async for`, and `sleep` is awaited."""

    def __init__(
        self,
        base_url: str = calls.DEFAULT_BASE_URL,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        **settings: Unpack[calls.ClientSettings],
    ) -> None:
        self.retry = calls.retry_policy(settings)
        self._http = httpx.AsyncClient(transport=transport, **calls.http_options(base_url, settings))
        self._endpoints = calls.Endpoints()
        self._sleep = sleep

    async def completions(self, prompt: params.Prompt, **args: Unpack[params.CompletionArgs]) -> api.CompletionResponse:
        model = await self._model(args)
        return await self._call(self._endpoints.completions(prompt, model, args))

    async def completions_stream(
        self, prompt: params.Prompt, **args: Unpack[params.CompletionStreamArgs]
    ) -> AsyncChunkStream[api.CompletionStreamResponse]:
        model = await self._model(args)
        return await self._stream(self._endpoints.completions_stream(prompt, model, args))

    async def chat(
        self, messages: Sequence[params.ChatMessage], **args: Unpack[params.ChatArgs]
    ) -> api.ChatCompletionResponse:
        model = await self._model(args)
        return await self._call(self._endpoints.chat(messages, model, args))

    async def chat_stream(
        self, messages: Sequence[params.ChatMessage], **args: Unpack[params.ChatStreamArgs]
    ) -> AsyncChunkStream[api.ChatCompletionStreamResponse]:
        model = await self._model(args)
        return await self._stream(self._endpoints.chat_stream(messages, model, args))

    async def tokenize(
        self,
        prompt: str | None = None,
        messages: Sequence[params.ChatMessage] | None = None,
        **args: Unpack[params.TokenizeArgs],
    ) -> api.TokenizeResponse:
        return await self._call(self._endpoints.tokenize(prompt, messages, args))

    async def detokenize(
        self, tokens: Sequence[int], *, model: str | None = None, timeout: params.Timeout = None
    ) -> api.DetokenizeResponse:
        return await self._call(self._endpoints.detokenize(tokens, model, timeout))

    async def models(self, *, timeout: params.Timeout = None) -> api.ModelList:
        return await self._call(self._endpoints.models(timeout))

    async def health(self, *, timeout: params.Timeout = None) -> bool:
        try:
            return await self._call(self._endpoints.health(timeout))
        except ServiceUnavailableError:
            return False

    async def metrics(self, *, timeout: params.Timeout = None) -> dict[str, list[MetricSample]]:
        return await self._call(self._endpoints.metrics(timeout))

    async def _model(self, args: calls.CallOptions) -> str:
        if self._endpoints.needs_models(args):
            await self.models()
        return self._endpoints.model_for(args)

    async def _call(self, call: Call[R]) -> R:
        return call.read(await self._send(call.request))

    async def _stream(self, call: StreamCall[T]) -> AsyncChunkStream[T]:
        return AsyncChunkStream(await self._send(call.request), call.chunk_type)

    async def _send(self, request: Request) -> httpx.Response:
        attempts = self.retry.attempts()
        while True:
            try:
                return await self._send_once(request)
            except CadenceError as error:
                delay = attempts.next_delay(error) if request.retry else None
                if delay is None:
                    raise
            await self._sleep(delay)

    async def _send_once(self, request: Request) -> httpx.Response:
        with transport_errors():
            response = await self._http.send(request.build(self._http), stream=request.stream)
            if response.is_error and request.stream:
                await response.aread()
        if response.is_error:
            raise error_from_response(response)
        return response

    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
