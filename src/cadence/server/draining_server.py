"""uvicorn's server with Cadence's shutdown: SIGHUP drains like SIGTERM, and the requests
still running at `--shutdown-timeout` end with an answer (server/shutdown_deadline.py)."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType

import uvicorn

from cadence.server.shutdown_deadline import ShutdownDeadline


class DrainingServer(uvicorn.Server):
    """A `uvicorn.Server` whose shutdown starts `deadline`; give it a `uvicorn.Config`
    whose `timeout_graceful_shutdown` is `deadline.server_timeout`."""

    def __init__(self, config: uvicorn.Config, deadline: ShutdownDeadline) -> None:
        super().__init__(config)
        self.deadline = deadline

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.deadline.start()
        try:
            await super().shutdown(sockets)
        finally:
            self.deadline.cancel()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGINT and SIGTERM, and SIGHUP as a SIGTERM.

        A server has no terminal to reload for, and SIGHUP's default would end it at once,
        cutting every stream and leaving its engines behind. Under nohup, which ignores
        SIGHUP, it stays ignored.
        """
        inherited = signal.getsignal(signal.SIGHUP)
        if inherited is signal.SIG_IGN or threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return

        def as_sigterm(_: int, frame: FrameType | None) -> None:
            self.handle_exit(signal.SIGTERM, frame)

        signal.signal(signal.SIGHUP, as_sigterm)
        try:
            with super().capture_signals():
                yield
        finally:
            # None: a handler from outside Python, which cannot be put back; the default then.
            signal.signal(signal.SIGHUP, signal.SIG_DFL if inherited is None else inherited)
