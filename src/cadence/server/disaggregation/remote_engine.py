"""A router's handle on one worker's engine on another host (`cadence router`).

The worker is named by its HTTP URL. Its `/worker` route says which port its link
listens on (server/disaggregation/worker_link.py); a `RemoteEngine` opens a session there,
gets the engine's EngineReady, and from then on drives the engine as a `LocalEngine`
drives a local one: the client and the coordinator cannot tell the two apart.

A session ends when the worker says its engine died, when it falls silent for longer
than the link's timeout (a dead host, a partition), or when it refuses the session.
The remote engine then reports the engine dead and keeps trying: each try is a new session on a
new socket, so nothing queued for the old one reaches the new. A worker that answers
again is re-admitted; the others never notice.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import urllib.request
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

import zmq
import zmq.asyncio

from cadence.engine.protocol import (
    EngineCoreOutputs,
    EngineDead,
    EngineReady,
    EngineStats,
    LinkGoodbye,
    LinkHeartbeat,
    LinkHello,
    Message,
    decode,
    encode,
)
from cadence.server.disaggregation.topology import LinkTiming
from cadence.server.disaggregation.worker_link import tcp_address
from cadence.server.engine_events import DrainingChanged, EngineDied, EngineServing, EventSink, OutputsArrived
from cadence.server.engine_handle import EngineCounters
from cadence.server.engine_process import EngineDeadError

logger = logging.getLogger(__name__)

# Seconds between tries to reach a worker that is gone, and one that was refused.
RETRY_DELAY = 1.0
REFUSED_DELAY = 10.0
# Messages handled between checks of the connection, the silence and the heartbeat.
_BATCH = 64


def link_address(url: str, port: int) -> str:
    """The ZMQ address of a worker's link: its HTTP host, the port it announced."""
    return tcp_address(urlsplit(url).hostname or "127.0.0.1", port)


# Workers are reached directly: a proxy from the environment would stand between them.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def fetch_worker_info(url: str, timeout: float) -> dict:
    """GET the worker's /worker description (blocking; run it in a thread)."""
    with _OPENER.open(url.rstrip("/") + "/worker", timeout=timeout) as response:
        return json.loads(response.read())


# Raises ValueError for an engine the router cannot work with (its KV layout, its limits).
ReadyCheck = Callable[[str, EngineReady], None]


def _accept_any(name: str, ready: EngineReady) -> None:
    pass


class RemoteEngine:
    """Drives the engine of the worker at `url`, whose role must be `role`."""

    def __init__(
        self,
        url: str,
        role: str,
        context: zmq.asyncio.Context,
        events: EventSink,
        timing: LinkTiming,
        check_ready: ReadyCheck = _accept_any,
    ) -> None:
        self.name = url
        self.role = role
        self.context = context
        self.events = events
        self.timing = timing
        self.check_ready = check_ready
        self.info: EngineReady | None = None
        self.stats = EngineStats()
        self.counters = EngineCounters()
        self.dead_reason: str | None = f"{url} has not been reached yet"
        self._admitted = False
        self.draining = False  # the worker is shutting down: it gets no new requests
        self._socket: zmq.asyncio.Socket | None = None
        self._said_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()
        self._stopping = False

    # ----- lifecycle -----------------------------------------------------------------
    def spawn(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"cadence-link-{self.name}")

    async def wait_ready(self, timeout: float) -> EngineReady:
        await asyncio.wait_for(self._ready.wait(), timeout)
        assert self.info is not None
        return self.info

    def fail(self, reason: str) -> None:
        """The client could not handle what the worker said: end the session as a broken
        link ends, and open a new one after the usual pause."""
        if not self._admitted or self._stopping or self._task is None:
            return
        session = self._task
        session.cancel()
        self._end(reason)
        self._task = asyncio.create_task(self._run_after(session), name=f"cadence-link-{self.name}")

    async def _run_after(self, session: asyncio.Task[None]) -> None:
        await asyncio.wait([session])  # its socket closes first
        await asyncio.sleep(RETRY_DELAY)
        await self._run()

    async def shutdown(self, timeout: float) -> None:
        self._stopping = True
        if self._socket is not None:
            with contextlib.suppress(zmq.ZMQError):
                await self._socket.send(encode(LinkGoodbye()), flags=zmq.NOBLOCK)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    @property
    def is_healthy(self) -> bool:
        return self._admitted and self.dead_reason is None

    @property
    def is_restarting(self) -> bool:
        return not self.is_healthy and not self._stopping

    @property
    def retry_after(self) -> int:
        return max(1, round(RETRY_DELAY))

    @property
    def unavailable_reason(self) -> str:
        return self.dead_reason or f"{self.name} is not serving"

    def send(self, message: Message) -> None:
        if not self.is_healthy or self._socket is None:
            raise EngineDeadError(self.unavailable_reason)
        # Unbounded and connected, the socket queues at once; a failure shows in the future.
        sent = asyncio.ensure_future(self._socket.send(encode(message), flags=zmq.NOBLOCK))
        if sent.done() and sent.exception() is not None:
            raise EngineDeadError(f"{self.name}: {sent.exception()}")
        sent.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, never warned of
        self._said_at = asyncio.get_running_loop().time()

    # ----- sessions ------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stopping:
            delay = RETRY_DELAY
            try:
                # The socket timeout does not bound the host name's lookup: the whole
                # request gets one deadline (a stuck lookup's thread ends on its own).
                described = await asyncio.wait_for(
                    asyncio.to_thread(fetch_worker_info, self.name, self.timing.timeout), 2 * self.timing.timeout
                )
                if described.get("role") != self.role:
                    raise ValueError(f"it is a {described.get('role')} worker, listed as {self.role}")
                address = link_address(self.name, int(described["link_port"]))
            except Exception as error:  # noqa: BLE001 - an unreachable or odd worker is retried
                self._end(f"{self.name} cannot be reached: {error or 'no answer in time'}")
                await asyncio.sleep(delay)
                continue
            socket = self.context.socket(zmq.DEALER)
            try:
                for option, value in ((zmq.LINGER, 0), (zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.IPV6, 1)):
                    socket.setsockopt(option, value)
                socket.connect(address)
                self._socket = socket
                if not await self._session(socket):
                    delay = REFUSED_DELAY
            except Exception as error:
                logger.exception("the link to %s failed", self.name)
                self._end(f"the link to {self.name} failed: {error!r}")
            finally:
                self._socket = None
                socket.close(linger=0)
            await asyncio.sleep(delay)

    async def _session(self, socket: zmq.asyncio.Socket) -> bool:
        """One session: hello, then messages until the worker dies, falls silent or
        refuses. False if the worker was refused (it is tried again less often).

        A dropped connection ends the session at once: the worker's process is gone, or
        it will take the reconnection for a stranger (ZMQ names each connection anew)."""
        loop = asyncio.get_running_loop()
        monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            await socket.send(encode(LinkHello(uuid.uuid4().hex)))
            heard_at = self._said_at = loop.time()
            while not self._stopping:
                ready = dict(await poller.poll(int(self.timing.heartbeat * 1000)))
                # What arrived before any disconnection first; a bounded batch, so a
                # backlog cannot keep heartbeats (and everything else) from running.
                for _ in range(_BATCH):
                    if not await socket.poll(0):
                        break
                    heard_at = loop.time()
                    over = self._handle(decode(await socket.recv()))
                    if over is not None:
                        if not over:
                            await socket.send(encode(LinkGoodbye()))
                        return over
                if monitor in ready:
                    self._end(f"{self.name} closed its link")
                    return True
                now = loop.time()
                if now - heard_at > self.timing.timeout:
                    self._end(f"{self.name} was silent for {self.timing.timeout:g} s")
                    return True
                if now - self._said_at >= self.timing.heartbeat:
                    await socket.send(encode(LinkHeartbeat()))
                    self._said_at = now
            return True
        finally:
            with contextlib.suppress(zmq.ZMQError):  # the context may be gone first
                socket.disable_monitor()
            monitor.close(linger=0)

    def _handle(self, message: Message) -> bool | None:
        """Act on one message from the worker: None while the session goes on, else
        whether it ended as sessions do (False: the worker was refused)."""
        if isinstance(message, EngineReady):
            return None if self._admit(message) else False
        if isinstance(message, EngineDead):
            self._end(f"{self.name}: {message.message}", engine_died=True)
            return True
        if isinstance(message, LinkHeartbeat) and message.draining != self.draining and self._admitted:
            self.draining = message.draining
            logger.warning("%s is %s", self.name, "draining" if self.draining else "serving again")
            self.events(DrainingChanged(self, self.draining))
        elif isinstance(message, EngineCoreOutputs) and self._admitted:
            self.stats = message.stats
            self.events(OutputsArrived(self, message))
        return None

    def _admit(self, ready: EngineReady) -> bool:
        self.info = ready
        self.dead_reason = None
        self.draining = False
        try:
            self.check_ready(self.name, ready)
        except ValueError as error:  # a layout or limit the other engines do not share
            self.dead_reason = f"{self.name} was refused: {error}"
            logger.error("%s", self.dead_reason)
            return False
        self._admitted = True
        self.events(EngineServing(self))
        logger.info("%s serves as a %s worker (%d KV blocks)", self.name, self.role, ready.num_kv_blocks)
        self._ready.set()
        return True

    def _end(self, reason: str, engine_died: bool = False) -> None:
        """The session is over: what the engine held is lost to this router. (The
        worker's step and preemption totals are its engine's own, so they are not
        carried over; a restart is counted when the worker says its engine died.)"""
        if self._admitted:
            self._admitted = False
            self.dead_reason = reason
            self.counters.restarts += engine_died
            self.stats = EngineStats()
            logger.error("%s", reason)
            self.events(EngineDied(self, reason))
        elif self.dead_reason != reason:
            self.dead_reason = reason
            logger.warning("%s", reason)
