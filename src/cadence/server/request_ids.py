"""X-Request-Id: taken from the request, or made here, and returned on the response.

The id names the API call's engine requests (`cmpl-<id>-0`, ...), so the engine's log
lines and the per-request log line carry it, and it is the `request_id` of every JSON
log line written while the call is served. A client's id is used as given, so two
concurrent calls with the same id are refused like any duplicate request id.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cadence.engine.log_format import CURRENT_REQUEST_ID
from cadence.server.errors import APIError

HEADER = b"x-request-id"
_VALID = re.compile(r"[!-~]{1,128}")  # printable ASCII without spaces: safe in ids, logs and headers


class RequestIdHeader:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(HEADER)
        if given is not None and not _VALID.fullmatch(given.decode("latin-1")):
            refusal = APIError(400, "X-Request-Id must be 1 to 128 printable ASCII characters, without spaces")
            await refusal.response()(scope, receive, send)
            return
        request_id = given.decode("ascii") if given is not None else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (HEADER, request_id.encode("ascii"))]
            await send(message)

        token = CURRENT_REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT_REQUEST_ID.reset(token)
