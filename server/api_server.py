"""The FastAPI app: routes, API-key and body-size guards, and the engine's lifetime.

The engine process starts in the app's lifespan, so uvicorn accepts no connection before
the model is loaded, and stops after uvicorn has drained in-flight requests.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cadence.engine.engine_args import EngineArgs
from cadence.engine.llm import load_tokenizer
from cadence.server.api_models import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.errors import APIError, install_error_handlers, unavailable
from cadence.server.metrics import build_registry, render
from cadence.server.prompts import PromptBuilder
from cadence.server.serving_chat import ChatHandler
from cadence.server.serving_completions import CompletionHandler

VERSION = "0.1.0"


@dataclass
class ServerConfig:
    """How the HTTP side behaves; the engine's own options live in EngineArgs."""

    served_model_names: list[str]
    api_key: str | None = None
    max_waiting: int = 1024
    max_request_body_bytes: int = 16 << 20
    engine_start_timeout: float = 600.0
    engine_stop_timeout: float = 10.0
    # Routes that need the API key when one is set; health, version and metrics stay open
    # so orchestrators and scrapers need no secret.
    protected_prefixes: tuple[str, ...] = field(default=("/v1/", "/tokenize", "/detokenize"))


class BodySizeLimit:
    """Answers 413 to a request body over the limit, whether or not it declared a length."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        # Read the body here, counting, and hand the app a replay of it.
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
        body = b"".join(chunks)
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(413, f"the request body is larger than {self.max_bytes} bytes", code="request_too_large")
        await error.response()(scope, receive, send)


class APIKeyCheck:
    """Answers 401 unless a protected route carries `Authorization: Bearer <key>`.

    Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would pass every
    streamed chunk through an extra task and memory stream.
    """

    def __init__(self, app: ASGIApp, api_key: str, protected_prefixes: tuple[str, ...]) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.protected_prefixes = protected_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.protected_prefixes):
            header = dict(scope["headers"]).get(b"authorization", b"").strip()
            scheme, _, token = header.partition(b" ")
            # Bytes, not str: compare_digest refuses non-ASCII strings.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.api_key):
                error = APIError(401, "missing or invalid API key", type="authentication_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


@dataclass
class Serving:
    """The request handlers, built once the engine reports its limits."""

    prompts: PromptBuilder
    completions: CompletionHandler
    chat: ChatHandler


def build_app(engine_args: EngineArgs, config: ServerConfig) -> FastAPI:
    """The app for one model; the engine process starts when the app does."""
    client = AsyncEngineClient(config.max_waiting)
    model_name = config.served_model_names[0]
    serving: list[Serving] = []  # filled once the engine has said what it can take

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        client.spawn(engine_args)
        try:
            # The tokenizer loads here while the engine process loads the model.
            tokenizer = await asyncio.to_thread(load_tokenizer, engine_args.model)
            info = await client.wait_ready(config.engine_start_timeout, tokenizer)
            prompts = PromptBuilder(tokenizer, info.max_model_len, info.vocab_size)
            serving.append(
                Serving(
                    prompts, CompletionHandler(client, prompts, model_name), ChatHandler(client, prompts, model_name)
                )
            )
            yield
        finally:
            await client.shutdown(config.engine_stop_timeout)

    app = FastAPI(title="Cadence", version=VERSION, lifespan=lifespan)
    install_error_handlers(app)
    registry = build_registry(client, model_name)
    created = int(time.time())

    if config.api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=config.api_key, protected_prefixes=config.protected_prefixes)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_request_body_bytes)

    def check_model(name: str | None) -> None:
        if name is not None and name not in config.served_model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {config.served_model_names}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await serving[0].completions.create(body, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body.model)
        return await serving[0].chat.create(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        assert client.info is not None
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "cadence",
                "root": engine_args.model,
                "max_model_len": client.info.max_model_len,
            }
            for name in config.served_model_names
        ]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> Response:
        if not client.is_healthy:
            return unavailable(client.dead_reason or "the engine is not running").response()
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": VERSION}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        prompts = serving[0].prompts
        if body.messages is not None:
            prompt = prompts.from_messages(body.messages, body.add_generation_prompt)
        else:
            prompt = prompts.from_completion_prompt(body.prompt or "", body.add_special_tokens)
        return {"tokens": prompt.token_ids, "count": len(prompt.token_ids), "max_model_len": prompts.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        prompts = serving[0].prompts
        return {"prompt": prompts.decode(body.tokens)}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(render(registry), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app
