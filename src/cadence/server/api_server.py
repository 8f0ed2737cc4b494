"""The FastAPI app: its configuration, API-key and body-size guards, and the engine's lifetime.

The routes themselves are in server/routes.py.

The engine process starts in the app's lifespan, so uvicorn accepts no connection before
the model is loaded, and stops after uvicorn has drained in-flight requests.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI

from cadence.engine.engine_args import EngineArgs
from cadence.server.chat_options import ChatOptions
from cadence.server.disaggregation.topology import LinkTiming, Topology, WorkerList
from cadence.server.disaggregation.worker_link import tcp_address
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.errors import install_error_handlers, unavailable
from cadence.server.guards import install_guards
from cadence.server.local_engine import RestartPolicy
from cadence.server.metrics import build_registry
from cadence.server.prompts import PromptBuilder
from cadence.server.request_limits import RequestLimits
from cadence.server.routes import VERSION, Routes, Serving
from cadence.server.serving_chat import ChatHandler
from cadence.server.serving_completions import CompletionHandler
from cadence.server.shutdown_deadline import CancelledAfterDeadline, ShutdownDeadline
from cadence.server.structured_requests import GrammarChecker
from cadence.tokenization.loading import load_tokenizer


@dataclass
class ServerConfig:
    """How the HTTP side behaves; the engine's own options live in EngineArgs."""

    served_model_names: list[str]
    api_key: str | None = None
    max_waiting: int = 1024
    max_request_body_bytes: int = 16 << 20
    request_limits: RequestLimits = field(default_factory=RequestLimits)  # n and n x max_tokens
    engine_start_timeout: float = 600.0
    engine_stop_timeout: float = 10.0
    # Routes that need the API key when one is set; health and version stay open so
    # orchestrators need no secret, and metrics too (as in vLLM) unless protect_metrics.
    protected_prefixes: tuple[str, ...] = field(default=("/v1/", "/tokenize", "/detokenize"))
    protect_metrics: bool = False
    metrics_prefix: str = "cadence"  # or "vllm": the same series under vLLM's prefix
    log_prompts: bool = False  # prompt and output text in the per-request log lines
    # Start a dead engine again (with backoff), or leave it dead for an orchestrator.
    engine_restart: bool = True
    engine_restart_limit: int = 5  # failed starts in a row before the server exits non-zero
    # Prefill and decode engines beside the server (engine/kv_transfer/); default: one engine.
    topology: Topology = field(default_factory=Topology)
    # A worker (topology.role prefill or decode): where routers reach its engine; port 0
    # takes any free port, announced at /worker.
    link_host: str = "127.0.0.1"
    link_port: int = 0
    link_timing: LinkTiming = field(default_factory=LinkTiming)
    link_drain_timeout: float = 30.0  # a stopping worker waits this long for routers' requests
    # A router: the workers whose engines it drives, instead of engines of its own.
    workers: WorkerList | None = None
    chat: ChatOptions = field(default_factory=ChatOptions)  # tool-call and reasoning parsers, chat template


def build_app(
    engine_args: EngineArgs,
    config: ServerConfig,
    on_fatal: Callable[[str], None] | None = None,
    shutdown: ShutdownDeadline | None = None,
) -> FastAPI:
    """The app for one model; the engine process starts when the app does.

    `on_fatal` is called when the engine cannot be started again: the server should stop
    and exit non-zero, so that its supervisor notices. When `shutdown`'s deadline passes,
    every request still in flight ends with a 503 (an error event, for a stream).
    """
    restart = RestartPolicy(enabled=config.engine_restart, max_failures=config.engine_restart_limit)
    client = AsyncEngineClient(config.max_waiting, restart, on_fatal, config.topology)
    client.log_prompts = config.log_prompts
    model_name = config.served_model_names[0]
    serving: list[Serving] = []  # filled once the engine has said what it can take

    lifespan = _engine_lifespan(engine_args, config, client, serving)
    app = FastAPI(title="Cadence", version=VERSION, lifespan=lifespan)
    install_error_handlers(app)
    registry = build_registry(client, model_name, config.metrics_prefix)
    routes = Routes(client, serving, registry, config.served_model_names, engine_args.model, config.topology.role)

    protected = config.protected_prefixes + (("/metrics",) if config.protect_metrics else ())
    install_guards(app, config.api_key, protected, config.max_request_body_bytes)
    if shutdown is not None:
        shutdown.on_expiry(lambda: client.end_all_requests(lambda: unavailable("the server is shutting down")))
        app.add_middleware(CancelledAfterDeadline, deadline=shutdown)  # outermost: nothing inside logs it
    app.include_router(routes.router())
    return app


def _engine_lifespan(
    engine_args: EngineArgs, config: ServerConfig, client: AsyncEngineClient, serving: list[Serving]
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's lifespan: start or connect the engines and build the request handlers
    into `serving`; afterwards drain the worker link and stop the engines."""
    model_name = config.served_model_names[0]

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if config.workers is not None:
            client.connect(config.workers, config.link_timing)
        else:
            client.spawn(engine_args)
        try:
            # The tokenizer loads here while the engine process loads the model.
            tokenizer = await asyncio.to_thread(load_tokenizer, engine_args.model)
            info = await client.wait_ready(config.engine_start_timeout, tokenizer)
            if config.workers is not None and tokenizer is not None and len(tokenizer) > info.vocab_size:
                raise RuntimeError(
                    f"the tokenizer of {engine_args.model} has {len(tokenizer)} tokens, the workers' model "
                    f"{info.vocab_size}: give the router the model the workers serve"
                )
            if config.topology.role != "colocated":
                client.open_link(tcp_address(config.link_host, config.link_port), config.link_timing)
            prompts = PromptBuilder(tokenizer, info.max_model_len, info.vocab_size, config.chat.chat_template)
            limits = config.request_limits
            grammars = grammar_checker(prompts, engine_args)
            serving.append(
                Serving(
                    prompts,
                    CompletionHandler(client, prompts, model_name, limits, grammars),
                    ChatHandler(client, prompts, model_name, limits, grammars, config.chat),
                    grammars,
                )
            )
            yield
        finally:
            await client.drain_link(config.link_drain_timeout)
            await client.shutdown(config.engine_stop_timeout)
            for built in serving:
                built.prompts.close()
                built.grammars.close()

    return lifespan


def grammar_checker(prompts: PromptBuilder, engine_args: EngineArgs) -> GrammarChecker:
    """Checks requests' constraints against the model's tokenizer, in the engine's time limit."""
    tokenizer = prompts.tokenizer
    eos = getattr(tokenizer, "eos_token_id", None)
    timeout = engine_args.structured_outputs_compile_timeout
    json_text = None if prompts.pool is None else prompts.pool.json
    return GrammarChecker(json_text, prompts.vocab_size, [] if eos is None else [eos], timeout)
