"""A worker's side of its links to routers on other hosts (`cadence serve --role ...`).

A worker is an ordinary server with one engine whose role is prefill or decode. Routers
(`cadence router`) drive that engine over a ZMQ ROUTER socket that this class binds: they
send it the engine's own messages (requests, aborts, KV loads and releases), and get
back the parts of each step's outputs that concern their requests.

Each link is a session, opened by `LinkHello` and ended by `LinkGoodbye`, by the
router's connection dropping, by silence longer than `timeout`, or by the engine dying.
When a session ends, what it started is aborted, so a router that died or lost the
network strands no KV block here; only prompt KV already offered to a reader is left to
the engine's hold deadline, since a decode engine may still be reading it. A worker
that is shutting down first drains: its heartbeats say so (routers send it nothing
new), and it waits for the requests it has.
A message from a session this worker does not know (one from before a restart, of this
worker or of its engine) is answered with `EngineDead` and never reaches the engine: a
router never has a request run that it has already failed. Both sides send
`LinkHeartbeat` while they have nothing else to say, so silence means a dead peer.

The port accepts engine messages from anyone who reaches it: bind it to a cluster
network, as vLLM's and SGLang's KV side channels are.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from cadence.engine.protocol import (
    AbortRequests,
    CancelKVWait,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    EngineStats,
    ExtendKVWait,
    LinkGoodbye,
    LinkHeartbeat,
    LinkHello,
    LoadKV,
    Message,
    ReleaseKV,
    decode,
    encode,
)
from cadence.server.disaggregation.topology import LinkTiming
from cadence.server.engine_process import EngineDeadError

logger = logging.getLogger(__name__)

# What a router may ask of a worker's engine; Shutdown, for one, stays the worker's own.
_ENGINE_MESSAGES = (EngineCoreRequest, AbortRequests, LoadKV, ReleaseKV, CancelKVWait, ExtendKVWait)


def tcp_address(host: str, port: int) -> str:
    """A ZMQ TCP address; IPv6 hosts in brackets."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


@dataclass
class _Session:
    session: str
    heard_at: float
    said_at: float = 0.0
    requests: dict[str, set[int]] = field(default_factory=dict)  # request id -> its unfinished sequences
    held: set[str] = field(default_factory=set)  # requests whose prompt KV waits for a reader


class WorkerLink:
    """Serves this worker's engine to routers: `send` is the way to the engine."""

    def __init__(
        self, context: zmq.asyncio.Context, address: str, send: Callable[[Message], None], timing: LinkTiming
    ) -> None:
        self._socket = context.socket(zmq.ROUTER)
        for option, value in ((zmq.SNDHWM, 0), (zmq.RCVHWM, 0), (zmq.LINGER, 0), (zmq.IPV6, 1)):
            self._socket.setsockopt(option, value)
        # A send to a router whose connection dropped fails (EHOSTUNREACH) instead of
        # vanishing: that ends its session. The monitor says when to try.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.bind(address)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._send_to_engine = send
        self.timing = timing
        self.ready: EngineReady | None = None
        self.dead_reason = "the engine is starting"
        self.draining = False
        self.sessions: dict[bytes, _Session] = {}
        self._owner: dict[str, bytes] = {}  # request id -> the peer that sent it
        self._stats = EngineStats()  # the engine's latest gauges
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._receive(), name="cadence-link-receive"),
            asyncio.create_task(self._keep_alive(), name="cadence-link-keepalive"),
            asyncio.create_task(self._watch_disconnections(), name="cadence-link-monitor"),
        ]

    async def drain(self, timeout: float) -> None:
        """Stop taking sessions, tell the routers (they route new requests elsewhere), and
        wait up to `timeout` for the requests they sent to end."""
        self.draining = True
        for peer in list(self.sessions):
            self._say(peer, LinkHeartbeat(draining=True))
        deadline = asyncio.get_running_loop().time() + timeout
        while self._owner and asyncio.get_running_loop().time() < deadline:
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        for peer in list(self.sessions):
            self._end_session(peer, "the worker is shutting down")
        with contextlib.suppress(zmq.ZMQError):
            self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close(linger=0)

    # ----- the engine's side ---------------------------------------------------------
    def on_engine_ready(self, ready: EngineReady) -> None:
        """The engine (re)started: sessions opened from now on can use it."""
        self.ready, self.dead_reason = ready, ""

    def on_engine_dead(self, reason: str) -> None:
        """Every session ends with the engine: its requests are gone, and the routers
        must say hello to the next engine before they use it."""
        self.ready, self.dead_reason = None, reason
        for peer in list(self.sessions):
            self._say(peer, EngineDead(reason))
            self.sessions.pop(peer, None)
        self._owner.clear()

    def on_outputs(self, message: EngineCoreOutputs) -> int:
        """Hand each session the part of a step that concerns its requests, the gauges and
        the step's stats. Returns how many tokens the routers' requests gained."""
        self._stats = message.stats
        parts = {peer: EngineCoreOutputs([], message.stats, step=message.step) for peer in self.sessions}
        generated = 0

        def part(request_id: str) -> EngineCoreOutputs | None:
            peer = self._owner.get(request_id)
            return None if peer is None else parts.get(peer)

        # KV events first: a request that finishes in this step is forgotten below.
        for reserved in message.kv_reserved:
            if (target := part(reserved.request_id)) is not None:
                target.kv_reserved.append(reserved)
        for prefilled in message.kv_prefilled:
            if (target := part(prefilled.request_id)) is not None:
                target.kv_prefilled.append(prefilled)
                self.sessions[self._owner[prefilled.request_id]].held.add(prefilled.request_id)
        for loaded in message.kv_loaded:
            if (target := part(loaded.request_id)) is not None:
                target.kv_loaded.append(loaded)
        for output in message.outputs:
            if (target := part(output.request_id)) is not None:
                target.outputs.append(output)
                generated += len(output.new_token_ids)
                if output.finished:
                    self._sequences_over(output.request_id, [output.index])
        for request_id, reason in message.rejected.items():
            if (target := part(request_id)) is not None:
                target.rejected[request_id] = reason
                self._forget(request_id)
        for peer, outputs in parts.items():
            self._say(peer, outputs)
        return generated

    # ----- the routers' side ---------------------------------------------------------
    async def _receive(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            try:
                if len(frames) != 2:
                    raise ValueError(f"{len(frames)} frames")
                peer, data = frames
                message = decode(data)
            except Exception as error:  # noqa: BLE001 - a bad message from the network is dropped, not fatal
                logger.warning("dropped a malformed message on the worker link: %s", error)
                continue
            try:
                self._handle(peer, message)
            except Exception:  # one router's bad message must not end the link
                logger.exception("a router's %s was refused", type(message).__name__)

    def _handle(self, peer: bytes, message: Message) -> None:
        now = asyncio.get_running_loop().time()
        if isinstance(message, LinkHello):
            if peer in self.sessions:
                self._end_session(peer, "the router opened a new session on the same link")
            if self.ready is None or self.draining:
                self._say(peer, EngineDead("the worker is shutting down" if self.draining else self.dead_reason))
                return
            self.sessions[peer] = _Session(message.session, heard_at=now)
            logger.info("a router opened session %s", message.session)
            self._say(peer, self.ready)
            return
        session = self.sessions.get(peer)
        if session is None:
            self._say(peer, EngineDead("no such session on this worker: say hello again"))
            return
        session.heard_at = now
        if isinstance(message, LinkGoodbye):
            self._end_session(peer, "the router said goodbye")
        elif isinstance(message, LinkHeartbeat):
            pass
        elif isinstance(message, _ENGINE_MESSAGES):
            self._to_engine(peer, session, message)
        else:
            raise TypeError(f"a router cannot send {type(message).__name__}")

    def _to_engine(self, peer: bytes, session: _Session, message: Message) -> None:
        if isinstance(message, EngineCoreRequest):
            if message.request_id in self._owner:
                # Another session's id: refuse it here, so its owner's request goes on.
                self._say(peer, EngineCoreOutputs([], self._stats, {message.request_id: "the request id is in use"}))
                return
            self._owner[message.request_id] = peer
            session.requests[message.request_id] = set(range(message.sampling_params.n))
        elif isinstance(message, AbortRequests | ReleaseKV | CancelKVWait | ExtendKVWait | LoadKV):
            ids = [message.request_id] if isinstance(message, LoadKV) else list(message.request_ids)
            if isinstance(message, AbortRequests):
                ids += [request_id for request_id, _ in message.sequences]
            if any(self._owner.get(request_id) != peer for request_id in ids):
                return  # only the session that sent a request may steer it
            if isinstance(message, AbortRequests | ReleaseKV):
                for request_id in message.request_ids:
                    self._forget(request_id)
            if isinstance(message, AbortRequests):
                for request_id, index in message.sequences:
                    self._sequences_over(request_id, [index])
        try:
            self._send_to_engine(message)
        except EngineDeadError:
            pass  # the engine's death ends this session when it is noticed

    # ----- sessions ------------------------------------------------------------------
    async def _keep_alive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self.timing.heartbeat / 2)
            now = loop.time()
            for peer, session in list(self.sessions.items()):
                if now - session.heard_at > self.timing.timeout:
                    self._end_session(peer, f"the router was silent for {self.timing.timeout:g} s")
                elif now - session.said_at >= self.timing.heartbeat:
                    self._say(peer, LinkHeartbeat(draining=self.draining))

    async def _watch_disconnections(self) -> None:
        """A connection dropped: find whose by speaking to every session."""
        while True:
            await self._monitor.recv_multipart()
            for peer in list(self.sessions):
                self._say(peer, LinkHeartbeat(draining=self.draining))

    def _end_session(self, peer: bytes, reason: str) -> None:
        """Abort what the session started, except prompt KV a decode engine may be reading:
        freed now, its blocks could be refilled under the read. The engine's hold deadline
        frees it."""
        session = self.sessions.pop(peer, None)
        if session is None:
            return
        ids = [request_id for request_id in session.requests if self._owner.get(request_id) == peer]
        for request_id in ids:
            del self._owner[request_id]
        aborted = [request_id for request_id in ids if request_id not in session.held]
        logger.warning(
            "router session %s ended (%s); aborting its %d requests, leaving %d prompts' KV to expire",
            session.session,
            reason,
            len(aborted),
            len(ids) - len(aborted),
        )
        if aborted and self.ready is not None:
            with contextlib.suppress(EngineDeadError):
                self._send_to_engine(AbortRequests(aborted))

    def _sequences_over(self, request_id: str, indices: list[int]) -> None:
        session = self.sessions.get(self._owner.get(request_id, b""))
        if session is None or request_id not in session.requests:
            return
        session.requests[request_id].difference_update(indices)
        if not session.requests[request_id]:
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        peer = self._owner.pop(request_id, None)
        session = self.sessions.get(peer) if peer is not None else None
        if session is not None:
            session.requests.pop(request_id, None)
            session.held.discard(request_id)

    def _say(self, peer: bytes, message: Message) -> None:
        session = self.sessions.get(peer)
        if session is not None:
            session.said_at = asyncio.get_running_loop().time()
        # Unbounded, the socket sends at once or fails at once; the future says which.
        sent = asyncio.ensure_future(self._socket.send_multipart([peer, encode(message)], flags=zmq.NOBLOCK))
        error = sent.exception() if sent.done() else None
        if isinstance(error, zmq.ZMQError) and error.errno == zmq.EHOSTUNREACH:
            self._end_session(peer, "the router's connection dropped")
        elif not sent.done():
            sent.add_done_callback(lambda done: done.cancelled() or done.exception())  # retrieved, never warned of
