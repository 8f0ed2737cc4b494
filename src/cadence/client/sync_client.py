"""`Client`: the blocking client of a Cadence server (or any OpenAI-compatible one)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TypeVar

import httpx
from pydantic import BaseModel
from typing_extensions import Unpack

from cadence.client import calls, params
from cadence.client.calls import Call, Request, StreamCall
from cadence.client.errors import CadenceError, ServiceUnavailableError, error_from_response, transport_errors
from cadence.client.metrics import MetricSample
from cadence.client.sse import ChunkStream
from cadence.openai_schema import responses as api

R = TypeVar("R")
T = TypeVar("T", bound=BaseModel)


class Client:
    """Completions, chat (plain and streamed), tokenization, models, health and metrics.

    `base_url` is the server's root, with or without "/v1"; the other settings are
    `calls.ClientSettings` (api_key, timeout, max_retries, retry, headers). `transport`
    replaces httpx's (tests use httpx.MockTransport) and `sleep` the wait between attempts.

    The generation calls take the sampling parameters of cadence/client/params.py as
    keyword arguments, with `model` (default: the first one /v1/models lists), `timeout`
    (this call's) and `extra_body`. Failures raise the classes of cadence/client/errors.py;
    429, 503 and connection failures are retried first (cadence/client/retry.py).
    """

    def __init__(
        self,
        base_url: str = calls.DEFAULT_BASE_URL,
        *,
        transport: httpx.BaseTransport | None = None,
        sleep: Callable[[float], None] = time.sleep,
        **settings: Unpack[calls.ClientSettings],
    ) -> None:
        self.retry = calls.retry_policy(settings)
        self._http = httpx.Client(transport=transport, **calls.http_options(base_url, settings))
        self._endpoints = calls.Endpoints()
        self._sleep = sleep

    def completions(self, prompt: params.Prompt, **args: Unpack[params.CompletionArgs]) -> api.CompletionResponse:
        """POST /v1/completions: text for a prompt (text or token ids, or a list of them)."""
        return self._call(self._endpoints.completions(prompt, self._model(args), args))

    def completions_stream(
        self, prompt: params.Prompt, **args: Unpack[params.CompletionStreamArgs]
    ) -> ChunkStream[api.CompletionStreamResponse]:
        """POST /v1/completions, streamed: iterate the chunks; close the stream to stop early."""
        return self._stream(self._endpoints.completions_stream(prompt, self._model(args), args))

    def chat(
        self, messages: Sequence[params.ChatMessage], **args: Unpack[params.ChatArgs]
    ) -> api.ChatCompletionResponse:
        """POST /v1/chat/completions."""
        return self._call(self._endpoints.chat(messages, self._model(args), args))

    def chat_stream(
        self, messages: Sequence[params.ChatMessage], **args: Unpack[params.ChatStreamArgs]
    ) -> ChunkStream[api.ChatCompletionStreamResponse]:
        """POST /v1/chat/completions, streamed."""
        return self._stream(self._endpoints.chat_stream(messages, self._model(args), args))

    def tokenize(
        self,
        prompt: str | None = None,
        messages: Sequence[params.ChatMessage] | None = None,
        **args: Unpack[params.TokenizeArgs],
    ) -> api.TokenizeResponse:
        """POST /tokenize: the token ids of a prompt, or of chat messages through the template."""
        return self._call(self._endpoints.tokenize(prompt, messages, args))

    def detokenize(
        self, tokens: Sequence[int], *, model: str | None = None, timeout: params.Timeout = None
    ) -> api.DetokenizeResponse:
        """POST /detokenize: the text of token ids."""
        return self._call(self._endpoints.detokenize(tokens, model, timeout))

    def models(self, *, timeout: params.Timeout = None) -> api.ModelList:
        """GET /v1/models."""
        return self._call(self._endpoints.models(timeout))

    def health(self, *, timeout: params.Timeout = None) -> bool:
        """GET /health: True when the server serves, False when it answers 503 (asked once,
        never retried; a server that cannot be reached raises APIConnectionError)."""
        try:
            return self._call(self._endpoints.health(timeout))
        except ServiceUnavailableError:
            return False

    def metrics(self, *, timeout: params.Timeout = None) -> dict[str, list[MetricSample]]:
        """GET /metrics, parsed: samples by name (cadence/client/metrics.py)."""
        return self._call(self._endpoints.metrics(timeout))

    def _model(self, args: calls.CallOptions) -> str:
        if self._endpoints.needs_models(args):
            self.models()
        return self._endpoints.model_for(args)

    def _call(self, call: Call[R]) -> R:
        return call.read(self._send(call.request))

    def _stream(self, call: StreamCall[T]) -> ChunkStream[T]:
        return ChunkStream(self._send(call.request), call.chunk_type)

    def _send(self, request: Request) -> httpx.Response:
        """The answer to `request`, retried as the policy says; a stream's body is left
        unread, so a failure once it has begun is never retried."""
        attempts = self.retry.attempts()
        while True:
            try:
                return self._send_once(request)
            except CadenceError as error:
                delay = attempts.next_delay(error) if request.retry else None
                if delay is None:
                    raise
            self._sleep(delay)

    def _send_once(self, request: Request) -> httpx.Response:
        with transport_errors():
            response = self._http.send(request.build(self._http), stream=request.stream)
            if response.is_error and request.stream:
                response.read()
        if response.is_error:
            raise error_from_response(response)
        return response

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
