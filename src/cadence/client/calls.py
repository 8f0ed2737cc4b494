"""What each endpoint sends and how its answer is read, shared by `Client` and `AsyncClient`.

Nothing here does I/O: an endpoint method returns a `Call` (a request and the function
that reads a whole answer) or a `StreamCall` (a request and the type of its chunks), and
each client sends it its own way. The default model, the first one /v1/models lists, is
remembered here once either client has asked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Literal, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from typing_extensions import TypedDict

from cadence.client.errors import CadenceError
from cadence.client.metrics import MetricSample, parse_metrics
from cadence.client.params import (
    CallOptions,
    ChatArgs,
    ChatMessage,
    ChatStreamArgs,
    CompletionArgs,
    CompletionStreamArgs,
    Prompt,
    Timeout,
    TokenizeArgs,
    request_body,
)
from cadence.client.retry import RetryPolicy
from cadence.openai_schema.responses import (
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
)

DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# Generation can take minutes; a server that does not accept a connection in seconds is down.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)

R = TypeVar("R")
T = TypeVar("T", bound=BaseModel)
M = TypeVar("M", bound=BaseModel)


def server_root(base_url: str) -> str:
    """The server's root URL: `base_url` without a trailing "/v1" (either is accepted)."""
    root = base_url.rstrip("/")
    return root.removesuffix("/v1")


class ClientSettings(TypedDict, total=False):
    """What both clients are built with, besides the URL. `api_key` is sent as a bearer
    token; `timeout` (default 600 s, 10 s to connect) bounds each attempt of a call;
    `max_retries` (default 2) or a whole `retry` policy say how failures are retried;
    `headers` go with every request."""

    api_key: str | None
    timeout: Timeout
    max_retries: int
    retry: RetryPolicy
    headers: Mapping[str, str]


def http_options(base_url: str, settings: ClientSettings) -> dict[str, Any]:
    """The settings both clients give their httpx client."""
    headers = {"Accept": "application/json", **settings.get("headers", {})}
    api_key = settings.get("api_key")
    if api_key is not None:
        headers["Authorization"] = f"Bearer {api_key}"
    timeout = settings.get("timeout", DEFAULT_TIMEOUT)
    return {"base_url": server_root(base_url), "headers": headers, "timeout": timeout}


def retry_policy(settings: ClientSettings) -> RetryPolicy:
    """The policy of `settings`, or the default one, with their `max_retries` if given."""
    policy = settings.get("retry") or RetryPolicy()
    max_retries = settings.get("max_retries")
    if max_retries is not None and max_retries != policy.max_retries:
        policy = replace(policy, max_retries=max_retries)
    return policy


@dataclass(frozen=True)
class Request:
    """One HTTP request of a call, sent again as it is when retried. A None timeout is the
    client's; `retry` False sends it once whatever happens (health checks)."""

    method: Literal["GET", "POST"]
    path: str
    body: dict[str, Any] | None = None
    timeout: Timeout = None
    stream: bool = False
    retry: bool = True

    def build(self, http: httpx.Client | httpx.AsyncClient) -> httpx.Request:
        timeout = httpx.USE_CLIENT_DEFAULT if self.timeout is None else self.timeout
        return http.build_request(self.method, self.path, json=self.body, timeout=timeout)


@dataclass(frozen=True)
class Call(Generic[R]):
    """A call answered in one piece, and how to read the answer."""

    request: Request
    read: Callable[[httpx.Response], R]


@dataclass(frozen=True)
class StreamCall(Generic[T]):
    """A streamed call, and the type of its chunks."""

    request: Request
    chunk_type: type[T]


def _parse(model: type[M], response: httpx.Response) -> M:
    """The answer as `model`; an answer of another shape is a CadenceError like every other failure."""
    try:
        return model.model_validate_json(response.content)
    except ValidationError as invalid:
        raise CadenceError(f"the server's answer is not a {model.__name__}: {response.text[:200]}") from invalid


def _reader(model: type[M]) -> Callable[[httpx.Response], M]:
    return lambda response: _parse(model, response)


class Endpoints:
    """The API's calls, built from a method's arguments."""

    def __init__(self) -> None:
        self.default_model: str | None = None

    def needs_models(self, args: CallOptions) -> bool:
        """Whether a call with `args` must first learn the default model."""
        return "model" not in args and self.default_model is None

    def model_for(self, args: CallOptions) -> str:
        """The model a call with `args` is for."""
        if "model" in args:
            return args["model"]
        if self.default_model is None:
            raise CadenceError("the server lists no models; name one with model=")
        return self.default_model

    def _remember(self, response: httpx.Response) -> ModelList:
        listed = _parse(ModelList, response)
        if listed.data and self.default_model is None:
            self.default_model = listed.data[0].id
        return listed

    def models(self, timeout: Timeout = None) -> Call[ModelList]:
        return Call(Request("GET", "/v1/models", timeout=timeout), self._remember)

    def completions(self, prompt: Prompt, model: str, args: CompletionArgs) -> Call[CompletionResponse]:
        body = request_body(CompletionArgs, {"model": model, "prompt": prompt}, args)
        request = Request("POST", "/v1/completions", body, args.get("timeout"))
        return Call(request, _reader(CompletionResponse))

    def completions_stream(
        self, prompt: Prompt, model: str, args: CompletionStreamArgs
    ) -> StreamCall[CompletionStreamResponse]:
        body = request_body(CompletionStreamArgs, {"model": model, "prompt": prompt, "stream": True}, args)
        request = Request("POST", "/v1/completions", body, args.get("timeout"), stream=True)
        return StreamCall(request, CompletionStreamResponse)

    def chat(self, messages: Sequence[ChatMessage], model: str, args: ChatArgs) -> Call[ChatCompletionResponse]:
        body = request_body(ChatArgs, {"model": model, "messages": list(messages)}, args)
        request = Request("POST", "/v1/chat/completions", body, args.get("timeout"))
        return Call(request, _reader(ChatCompletionResponse))

    def chat_stream(
        self, messages: Sequence[ChatMessage], model: str, args: ChatStreamArgs
    ) -> StreamCall[ChatCompletionStreamResponse]:
        body = request_body(ChatStreamArgs, {"model": model, "messages": list(messages), "stream": True}, args)
        request = Request("POST", "/v1/chat/completions", body, args.get("timeout"), stream=True)
        return StreamCall(request, ChatCompletionStreamResponse)

    def tokenize(
        self, prompt: str | None, messages: Sequence[ChatMessage] | None, args: TokenizeArgs
    ) -> Call[TokenizeResponse]:
        if (prompt is None) == (messages is None):
            raise TypeError("give exactly one of prompt or messages")
        body: dict[str, Any] = {"prompt": prompt} if messages is None else {"messages": list(messages)}
        body.update({key: value for key, value in args.items() if key != "timeout"})
        return Call(Request("POST", "/tokenize", body, args.get("timeout")), _reader(TokenizeResponse))

    def detokenize(self, tokens: Sequence[int], model: str | None, timeout: Timeout) -> Call[DetokenizeResponse]:
        body: dict[str, Any] = {"tokens": list(tokens), **({} if model is None else {"model": model})}
        return Call(Request("POST", "/detokenize", body, timeout), _reader(DetokenizeResponse))

    def health(self, timeout: Timeout = None) -> Call[bool]:
        """200 is healthy; the client turns a 503 into False. Never retried: a probe
        reports the state now."""
        return Call(Request("GET", "/health", timeout=timeout, retry=False), lambda _: True)

    def metrics(self, timeout: Timeout = None) -> Call[dict[str, list[MetricSample]]]:
        return Call(Request("GET", "/metrics", timeout=timeout), lambda response: parse_metrics(response.text))
