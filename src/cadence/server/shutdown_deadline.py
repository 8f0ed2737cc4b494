"""The end of a graceful shutdown: what happens to requests still running at its deadline.

A stopping server (SIGTERM, SIGHUP, SIGINT) accepts no connection and waits up to
`--shutdown-timeout` for the requests it has. Left to uvicorn, the deadline cancels the
tasks of the ones still running: a stream then stops after an ordinary chunk, as if it
had been complete, and each cancellation logs a traceback. Instead, at the deadline every
request still in flight is ended with an answer: a stream gets an error event saying the
server is shutting down, then `[DONE]`; any other request a 503 with Retry-After. uvicorn's
own deadline comes `FINAL_EVENT_GRACE` later, for those last events to be written.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

logger = logging.getLogger(__name__)

# Seconds between the deadline and uvicorn's cancelling of whatever still runs: writing
# a final event takes milliseconds unless the client has stopped reading.
FINAL_EVENT_GRACE = 3.0


class ShutdownDeadline:
    """The deadline of one server's shutdown, started when uvicorn starts shutting down
    (server/draining_server.py); at expiry it calls what `on_expiry` registered."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.passed = False
        self._on_expiry: list[Callable[[], None]] = []
        self._timer: asyncio.TimerHandle | None = None

    @property
    def server_timeout(self) -> int:
        """The graceful-shutdown timeout to give uvicorn (whole seconds): after this
        deadline, by at least the grace."""
        return math.ceil(self.timeout + FINAL_EVENT_GRACE)

    def on_expiry(self, callback: Callable[[], None]) -> None:
        self._on_expiry.append(callback)

    def start(self) -> None:
        """Start counting (once), on the server's event loop."""
        if self._timer is None and not self.passed:
            self._timer = asyncio.get_running_loop().call_later(self.timeout, self._expire)

    def cancel(self) -> None:
        """The shutdown is over before the deadline: nothing is left to end."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        self.passed = True
        for callback in self._on_expiry:
            callback()


class CancelledAfterDeadline:
    """Ends quietly a request that uvicorn cancels after the deadline and its grace.

    Its client stopped reading, so not even the final event could be written: the
    connection closes, and a CancelledError traceback per such client would say nothing
    more. Before the deadline a cancellation is nobody's business here and goes on up.
    """

    def __init__(self, app: ASGIApp, deadline: ShutdownDeadline) -> None:
        self.app = app
        self.deadline = deadline

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # the lifespan is not a request: its end is not cut short
            await self.app(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        except asyncio.CancelledError:
            if not self.deadline.passed:
                raise
            logger.warning("%s: cut off at shutdown: the client read nothing since the deadline", scope.get("path"))
