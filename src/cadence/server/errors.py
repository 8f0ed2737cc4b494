"""OpenAI-style error bodies and the exception handlers that produce them.

Every error leaves the server as `{"error": {"message", "type", "param", "code"}}` with
the status OpenAI would use, so SDKs raise the exception class their users expect.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from cadence.openai_schema.responses import ErrorDetail, ErrorResponse

logger = logging.getLogger(__name__)

# Seconds a client should wait before retrying a request refused for load.
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    """An error a handler raises to answer with a given status and OpenAI error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorDetail(message=self.message, type=self.type, param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(mode="json"), status_code=self.status, headers=self.headers)

    def sse_event(self) -> str:
        """The error as one server-sent event, for failures in mid-stream."""
        return f"data: {self.body().model_dump_json()}\n\n"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def _retry_later(status: int, message: str, type: str, code: str, after: int = RETRY_AFTER_SECONDS) -> APIError:
    """A refusal the client should retry after `after` seconds."""
    return APIError(status, message, type=type, code=code, headers={"Retry-After": str(after)})


def overloaded(message: str) -> APIError:
    return _retry_later(429, message, "rate_limit_error", "rate_limit_exceeded")


def unavailable(message: str, after: int = RETRY_AFTER_SECONDS) -> APIError:
    return _retry_later(503, message, "service_unavailable", "service_unavailable", after)


def _field_path(loc: Sequence[Any]) -> list[str]:
    # Pydantic puts each union member's tag in loc ("list[int]", "function-after[...]",
    # or a discriminator tag, which in our models holds a space): none is a field.
    return [str(p) for p in loc if p != "body" and not (isinstance(p, str) and ("[" in p or " " in p))]


def _path(error: Mapping[str, Any]) -> str:
    return ".".join(_field_path(error.get("loc", ())))


def _validation_param(error: Mapping[str, Any], errors: Sequence[Mapping[str, Any]] = ()) -> str | None:
    # loc is ("body", "messages", 0, "content", ...); OpenAI names the field as a path.
    # A union adds one error per member: keep only what the errors about the same field
    # have in common.
    loc = tuple(error.get("loc", ()))
    for other in errors:
        other_loc = tuple(other.get("loc", ()))
        if other_loc[:2] == loc[:2]:
            common = 0
            while common < min(len(loc), len(other_loc)) and loc[common] == other_loc[common]:
                common += 1
            loc = loc[:common]
    return ".".join(_field_path(loc)) or None


async def _on_api_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, APIError)
    return error.response()


async def _on_validation_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, RequestValidationError)
    errors = error.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        # loc is ("body", byte offset): no field is at fault.
        offset = first.get("loc", ("body", "?"))[-1]
        return bad_request(f"the body is not valid JSON ({first.get('msg')} at byte {offset})").response()
    # About a field where one of our own checks failed (a value_error), that check says
    # more than the type mismatches of the union's other members, and names the exact
    # place: it speaks alone for that field.
    own_fields = {_path(e).split(".")[0] for e in errors if e.get("type") == "value_error"}
    errors = [e for e in errors if e.get("type") == "value_error" or _path(e).split(".")[0] not in own_fields]
    if errors and errors[0].get("type") == "value_error":
        param = _path(errors[0]) or None
    else:
        param = _validation_param(errors[0], errors) if errors else None
    message = "; ".join(f"{_path(e) or 'body'}: {e.get('msg', 'invalid')}".replace("Value error, ", "") for e in errors)
    return bad_request(message or "invalid request", param).response()


async def _on_http_error(_: Request, error: Exception) -> JSONResponse:
    assert isinstance(error, StarletteHTTPException)
    kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
    return APIError(error.status_code, str(error.detail), type=kind, headers=error.headers).response()


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _on_api_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
