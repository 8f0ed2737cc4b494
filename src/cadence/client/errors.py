"""The exceptions the client raises: one class per kind of failure, each carrying what the
server said.

An HTTP error answer becomes the `APIStatusError` subclass of its status, with the server's
error body parsed into its own model (`ErrorResponse`). An error the server sends in the
middle of a stream (its status line already said 200) becomes the class its error type
stands for. Failures below HTTP are `APIConnectionError`, or `APITimeoutError` when a
time limit ran out.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import httpx
from pydantic import ValidationError

from cadence.openai_schema.responses import ErrorDetail, ErrorResponse


class CadenceError(Exception):
    """The base of every error the client raises."""


class APIConnectionError(CadenceError):
    """The server could not be reached, or the connection broke before the answer ended."""


TimeoutPhase = Literal["connect", "read", "write", "pool"]


class APITimeoutError(APIConnectionError):
    """A time limit ran out. `phase` says where: "connect" and "pool" mean the request
    never reached the server; "read" and "write" mean it may have."""

    def __init__(self, message: str, phase: TimeoutPhase) -> None:
        super().__init__(message)
        self.phase: TimeoutPhase = phase


class APIStatusError(CadenceError):
    """The server answered with an error status; `body` is its error body, parsed (None
    when the answer was not one, say from a proxy)."""

    status_code: int = 0

    def __init__(self, status_code: int, body: ErrorResponse | None, headers: httpx.Headers, text: str = "") -> None:
        self.status_code = status_code
        self.body = body
        self.headers = headers
        detail = body.error if body is not None else None
        self.message = detail.message if detail is not None else (text.strip()[:500] or f"HTTP {status_code}")
        self.type = detail.type if detail is not None else None
        self.param = detail.param if detail is not None else None
        self.code = detail.code if detail is not None else None
        super().__init__(self._describe())

    @property
    def request_id(self) -> str | None:
        """The X-Request-Id the server gave the call, to find it in the server's logs."""
        return self.headers.get("x-request-id")

    def _describe(self) -> str:
        where = f" (param {self.param})" if self.param else ""
        kind = f" {self.type}" if self.type else ""
        return f"{self.status_code}{kind}: {self.message}{where}"


class BadRequestError(APIStatusError):
    """400: the request was invalid; `param` names the field at fault."""

    status_code = 400


class AuthenticationError(APIStatusError):
    """401: the API key is missing or wrong."""

    status_code = 401


class PermissionDeniedError(APIStatusError):
    """403: the key may not do this."""

    status_code = 403


class NotFoundError(APIStatusError):
    """404: no such route, or no such model."""

    status_code = 404


class RequestTooLargeError(APIStatusError):
    """413: the request body is over the server's limit."""

    status_code = 413


class UnprocessableEntityError(APIStatusError):
    """422: the body was well formed but could not be processed."""

    status_code = 422


class RateLimitError(APIStatusError):
    """429: the server is full; retried by default, honouring Retry-After."""

    status_code = 429


class InternalServerError(APIStatusError):
    """500: the server failed."""

    status_code = 500


class ServiceUnavailableError(APIStatusError):
    """503: the engine is down or restarting; retried by default, honouring Retry-After."""

    status_code = 503


STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    cls.status_code: cls
    for cls in (
        BadRequestError,
        AuthenticationError,
        PermissionDeniedError,
        NotFoundError,
        RequestTooLargeError,
        UnprocessableEntityError,
        RateLimitError,
        InternalServerError,
        ServiceUnavailableError,
    )
}

# The status each OpenAI error type is sent with (server/errors.py), for errors that come
# in a stream, after the status line.
_TYPE_STATUS = {
    "invalid_request_error": 400,
    "authentication_error": 401,
    "permission_error": 403,
    "not_found_error": 404,
    "rate_limit_error": 429,
    "server_error": 500,
    "service_unavailable": 503,
}


def status_error(
    status_code: int, body: ErrorResponse | None, headers: httpx.Headers, text: str = ""
) -> APIStatusError:
    """The exception for an error answer: the class of its status, else `APIStatusError`."""
    cls = STATUS_ERRORS.get(status_code, APIStatusError)
    return cls(status_code, body, headers, text)


def error_body(text: str | bytes) -> ErrorResponse | None:
    """The server's error body, or None when the text is not one."""
    try:
        return ErrorResponse.model_validate_json(text)
    except ValidationError:
        return None


def error_from_response(response: httpx.Response) -> APIStatusError:
    """The exception for an error answer whose body has been read."""
    return status_error(response.status_code, error_body(response.content), response.headers, response.text)


def error_from_event(detail: ErrorDetail, headers: httpx.Headers) -> APIStatusError:
    """The exception for an error event in a stream: the status its type is sent with, or
    the one its code names where that is an HTTP status (vLLM's)."""
    code = detail.code
    status_code = code if isinstance(code, int) and 400 <= code < 600 else _TYPE_STATUS.get(detail.type, 500)
    return status_error(status_code, ErrorResponse(error=detail), headers)


def _timeout_phase(error: httpx.TimeoutException) -> TimeoutPhase:
    if isinstance(error, httpx.ConnectTimeout):
        return "connect"
    if isinstance(error, httpx.PoolTimeout):
        return "pool"
    return "write" if isinstance(error, httpx.WriteTimeout) else "read"


def transport_error(error: httpx.TransportError) -> APIConnectionError:
    """The exception for a failure below HTTP."""
    if isinstance(error, httpx.TimeoutException):
        phase = _timeout_phase(error)
        return APITimeoutError(f"the call timed out ({phase}): {error}", phase)
    return APIConnectionError(f"{type(error).__name__}: {error}" if str(error) else type(error).__name__)


@contextmanager
def transport_errors() -> Iterator[None]:
    """Raise httpx's transport failures inside the block as this module's exceptions."""
    try:
        yield
    except httpx.TransportError as error:
        raise transport_error(error) from error
