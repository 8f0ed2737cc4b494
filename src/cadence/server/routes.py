"""The HTTP routes: the OpenAI-compatible API, tokenizing, and the server's own endpoints.

The handlers read the engine client and the request handlers that the app's lifespan
builds once the engine has said what it can take; api_server.py builds the app around them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry

from cadence.openai_schema.requests import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from cadence.openai_schema.responses import DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.errors import APIError, unavailable
from cadence.server.metrics import render
from cadence.server.prompts import PromptBuilder
from cadence.server.serving_chat import ChatHandler
from cadence.server.serving_completions import CompletionHandler
from cadence.server.structured_requests import GrammarChecker

VERSION = "0.1.0"


@dataclass
class Serving:
    """The request handlers, built once the engine reports its limits."""

    prompts: PromptBuilder
    completions: CompletionHandler
    chat: ChatHandler
    grammars: GrammarChecker


class Routes:
    """The route handlers of one app; `serving` holds its handlers once the engine is ready."""

    def __init__(
        self,
        client: AsyncEngineClient,
        serving: list[Serving],
        registry: CollectorRegistry,
        served_model_names: list[str],
        model_root: str,
        role: str,
    ) -> None:
        self.client = client
        self.serving = serving
        self.registry = registry
        self.served_model_names = served_model_names
        self.model_root = model_root  # where the model came from, shown in /v1/models
        self.role = role  # the topology role, shown to routers at /worker
        self.created = int(time.time())

    def router(self) -> APIRouter:
        """All routes, in the order the app has always registered them."""
        router = APIRouter()
        router.add_api_route("/v1/completions", self.completions, methods=["POST"], response_model=None)
        router.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"], response_model=None)
        router.add_api_route("/v1/models", self.models, methods=["GET"])
        router.add_api_route("/health", self.health, methods=["GET"])
        router.add_api_route("/worker", self.worker, methods=["GET"])
        router.add_api_route("/version", self.version, methods=["GET"])
        router.add_api_route("/tokenize", self.tokenize, methods=["POST"])
        router.add_api_route("/detokenize", self.detokenize, methods=["POST"])
        router.add_api_route("/metrics", self.metrics, methods=["GET"])
        return router

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {self.served_model_names}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        return await self.serving[0].completions.create(body, request)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        self.check_model(body.model)
        return await self.serving[0].chat.create(body, request)

    async def models(self) -> ModelList:
        client = self.client
        assert client.info is not None
        data = [
            ModelCard(
                id=name,
                created=self.created,
                owned_by="cadence",
                root=self.model_root,
                max_model_len=client.info.max_model_len,
            )
            for name in self.served_model_names
        ]
        return ModelList(data=data)

    async def health(self) -> Response:
        client = self.client
        if not client.is_healthy:
            return unavailable(client.unavailable_reason, client.retry_after).response()
        if client.coordinator is None:
            return Response(status_code=200)
        # Disaggregated: healthy while a decode engine serves; each engine's state is shown.
        return JSONResponse({"engines": client.health()})

    async def worker(self) -> Response:
        """What a router needs to drive this worker's engine."""
        if self.client.link is None:
            raise APIError(404, "this server is not a prefill or decode worker", type="not_found_error")
        return JSONResponse({"role": self.role, "link_port": self.client.link.port})

    async def version(self) -> dict:
        return {"version": VERSION}

    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        prompts = self.serving[0].prompts
        if body.messages is not None:
            prompt = await prompts.from_messages(
                body.messages, body.add_generation_prompt, body.tools, body.chat_template_kwargs
            )
        else:
            prompt = await prompts.from_completion_prompt(body.prompt or "", body.add_special_tokens)
        return TokenizeResponse(
            tokens=prompt.token_ids, count=len(prompt.token_ids), max_model_len=prompts.max_model_len
        )

    async def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        prompts = self.serving[0].prompts
        return DetokenizeResponse(prompt=await prompts.decode(body.tokens))

    async def metrics(self) -> Response:
        return Response(render(self.registry), media_type="text/plain; version=0.0.4; charset=utf-8")
