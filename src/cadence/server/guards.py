"""The plain-ASGI guards in front of every route: API key, body size, unexpected errors.

Plain ASGI rather than Starlette's BaseHTTPMiddleware, which would pass every streamed
chunk through an extra task and memory stream. `install_guards` puts them in the order
that matters: the key is checked before a byte of the body is read, so a client without
it cannot make the server buffer a large body.
"""

from __future__ import annotations

import hmac
import logging

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cadence.server.errors import APIError
from cadence.server.request_ids import RequestIdHeader

logger = logging.getLogger(__name__)

# Sent with a refusal that comes before the body is read: uvicorn then closes the
# connection instead of reading (and discarding) whatever body the client still sends.
_CLOSE = {"Connection": "close"}


class BodySizeLimit:
    """Answers 413 to a request body over the limit, whether or not it declared a length.

    The body is counted as it arrives and refused as soon as it passes the limit, so an
    over-limit body is never held whole.
    """

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
        # Read the body here, counting, and hand the app a replay of the same messages.
        messages: list[Message] = []
        size = 0
        more = True
        while more:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_bytes:
                messages.clear()
                await self._refuse(scope, receive, send)
                return
        await self.app(scope, _replay(messages, receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"the request body is larger than {self.max_bytes} bytes",
            code="request_too_large",
            headers=_CLOSE,
        )
        await error.response()(scope, receive, send)


class APIKeyCheck:
    """Answers 401 unless a protected route carries `Authorization: Bearer <key>`."""

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
                error = APIError(
                    401,
                    "missing or invalid API key",
                    type="authentication_error",
                    code="invalid_api_key",
                    headers=_CLOSE,
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class UnexpectedErrors:
    """Answers 500 with OpenAI's body to an exception no handler took, and keeps the
    connection: Starlette's own last-resort handler re-raises, and uvicorn then closes a
    keep-alive connection that other requests may be using."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watched_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        except Exception as error:
            logger.exception("unhandled error on %s", scope.get("path"), exc_info=error)
            if started:
                raise  # half an answer is out: only closing the connection tells the client
            answer = APIError(500, f"internal server error: {type(error).__name__}", type="server_error")
            await answer.response()(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed


def install_guards(app: FastAPI, api_key: str | None, protected_prefixes: tuple[str, ...], max_body: int) -> None:
    """Add the guards; the last one added runs first."""
    app.add_middleware(UnexpectedErrors)
    app.add_middleware(BodySizeLimit, max_bytes=max_body)
    if api_key is not None:
        app.add_middleware(APIKeyCheck, api_key=api_key, protected_prefixes=protected_prefixes)
    app.add_middleware(RequestIdHeader)  # outermost: every answer, refusals too, carries the id
