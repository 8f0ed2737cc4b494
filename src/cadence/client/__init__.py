"""The Python client of a Cadence server: `Client` (blocking) and `AsyncClient` (asyncio).

Answers are the response models the server builds its answers with
(cadence/openai_schema/responses.py); errors are one class per kind
(cadence/client/errors.py); 429, 503 and connection failures are retried with backoff
(cadence/client/retry.py). Only httpx, pydantic, prometheus_client and the OpenAI schema
are imported: not the server, not the engine, none of their dependencies
(tests/test_import_boundaries.py).
"""

from __future__ import annotations

from cadence.client.async_client import AsyncClient
from cadence.client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    CadenceError,
    InternalServerError,
    NotFoundError,
    PermissionDeniedError,
    RateLimitError,
    RequestTooLargeError,
    ServiceUnavailableError,
    UnprocessableEntityError,
)
from cadence.client.metrics import MetricSample, metric_value, parse_metrics
from cadence.client.params import ChatMessage, ChatParams, CompletionParams, GenerationParams, StreamOptions
from cadence.client.retry import RetryPolicy
from cadence.client.sse import AsyncChunkStream, ChunkStream
from cadence.client.sync_client import Client

__all__ = [
    "APIConnectionError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncChunkStream",
    "AsyncClient",
    "AuthenticationError",
    "BadRequestError",
    "CadenceError",
    "ChatMessage",
    "ChatParams",
    "ChunkStream",
    "Client",
    "CompletionParams",
    "GenerationParams",
    "InternalServerError",
    "MetricSample",
    "NotFoundError",
    "PermissionDeniedError",
    "RateLimitError",
    "RequestTooLargeError",
    "RetryPolicy",
    "ServiceUnavailableError",
    "StreamOptions",
    "UnprocessableEntityError",
    "metric_value",
    "parse_metrics",
]
