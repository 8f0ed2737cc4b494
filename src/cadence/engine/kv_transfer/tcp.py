"""KV transfer over TCP with ZMQ: the cross-host fallback where NIXL/UCX cannot be used.

A prefill engine binds a ROUTER socket on its `kv_host` and answers read requests from a
server thread: a request names block ids, and the reply carries those blocks of every
cache tensor (values, then scales, per layer), one contiguous frame per tensor, gathered
once and sent without a further copy. Only the named blocks cross the wire. The thread
keeps the engine's priority (unlike NIXL's progress thread it sleeps until asked, and
its gather lies on the request's time to first token); the blocks need no lock, since
the scheduler holds them unwritten until the reader releases them. A random token in
the address keeps a process that took over the port from answering for the engine that
advertised it.

A decode engine never touches a socket on its own thread: `start_load` checks the load
against the source's geometry and queues it, and one I/O thread owns every DEALER socket
(one per source, kept), sends the requests, checks each reply's sizes before writing any
byte, and scatters the blocks into the local caches. A read carries a sequence number,
so a reply to a load that was cancelled, timed out or failed is dropped unwritten. A
load is `waiting` until its reply is accepted, then `copying`, then reported: `cancel`
reports a waiting load at once, and a copying one once its copy is over, so nothing
writes into a load's blocks after `poll` reported it. A source that dies or cannot be
reached fails its loads when the socket monitor sees the connection go (or fail), and in
any case at a deadline that grows with the load's size: never a hang.

Copies on either side use numpy for CPU caches: torch would run them on an OpenMP team
of its own from this side thread, on top of the one the engine's forward pass uses.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import queue
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import zmq
from zmq.utils.monitor import parse_monitor_message

from cadence.engine.attention.backend import KVCache, split_kv_cache
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.kv_transfer.transport import KVTransport
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult

# A load fails unless its reply arrived within this, plus its bytes at `_MIN_RATE`: a
# long prompt over a slow link is no dead source. Well under the engines' kv_wait_timeout.
_TIMEOUT_S = 5.0
_MIN_RATE = 100e6  # bytes per second
_JOIN_S = 2.0  # how long `close` waits for each thread
_LOST = zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED  # the peer went, or refused


def _tensors(kv_caches: list[KVCache]) -> list[torch.Tensor]:
    return [tensor for cache in kv_caches for tensor in split_kv_cache(cache) if tensor is not None]


def _blocks(tensor: torch.Tensor) -> torch.Tensor:
    """A cache tensor's bytes as [halves, num_blocks, block_bytes]."""
    if tensor.dim() < 2 or not tensor.is_contiguous():
        raise ValueError("the TCP transport reads contiguous [2, num_blocks, ...] KV tensors only")
    return tensor.view(torch.uint8).view(tensor.shape[0], tensor.shape[1], -1)


def _geometry(tensor: torch.Tensor) -> list[Any]:
    raw = _blocks(tensor)
    return [raw.shape[0], raw.shape[1], raw.shape[2], str(tensor.dtype).removeprefix("torch.")]


def _gather(tensor: torch.Tensor, ids: np.ndarray) -> np.ndarray:
    raw = _blocks(tensor)
    if raw.device.type == "cpu":
        return np.take(raw.numpy(), ids, axis=1)
    return raw.index_select(1, torch.tensor(ids, device=raw.device)).cpu().numpy()


def _scatter(tensor: torch.Tensor, ids: list[int], data: memoryview) -> None:
    raw = _blocks(tensor)
    if raw.device.type == "cpu":
        raw.numpy()[:, ids] = np.frombuffer(data, dtype=np.uint8).reshape(raw.shape[0], len(ids), -1)
        return
    with torch.inference_mode():
        source = torch.frombuffer(data, dtype=torch.uint8).view(raw.shape[0], len(ids), -1)
        raw[:, torch.tensor(ids, device=raw.device)] = source.to(raw.device)
        torch.cuda.current_stream(raw.device).synchronize()  # landed before it is reported


class _Waker:
    """A pipe a thread polls beside its sockets: any thread may write to it, where a zmq
    socket may be used by one thread only."""

    def __init__(self) -> None:
        self.fd, self._write = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write, False)

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # full: the thread is woken already
            os.write(self._write, b"\0")

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._write)


@dataclass
class _Load:
    load: KVLoad
    seq: int
    endpoint: str
    token: bytes
    targets: list[torch.Tensor]
    sizes: list[int]  # bytes the reply must carry per tensor
    deadline: float
    state: str = "waiting"  # then "copying", then "done"
    cancelled: bool = False


class TcpTransport(KVTransport):
    """Blocks read from another engine's caches over TCP (ZMQ), in or across hosts."""

    name = "tcp"

    def __init__(self, exporting: bool = True, host: str = "127.0.0.1") -> None:
        self.exporting, self.host = exporting, host
        self._context = zmq.Context(io_threads=1)  # our own: closing it touches nobody else's sockets
        self._stop = threading.Event()
        self._threads: list[tuple[threading.Thread, _Waker]] = []
        self._exported: list[torch.Tensor] = []
        self._token = b""
        self._lock = threading.Lock()  # guards _loads, their states, and _results
        self._loads: dict[int, _Load] = {}  # by seq, until reported
        self._results: list[KVLoadResult] = []
        self._outbox: queue.SimpleQueue[_Load] = queue.SimpleQueue()
        self._io: _Waker | None = None
        self._seq = itertools.count(1)
        self._closed = False
        self._broken: str | None = None  # why the I/O thread ended, if it did unasked

    def export(self, kv_caches: list[KVCache], layout: KVLayout) -> KVSource:
        if not self.exporting:
            raise ValueError("this TCP transport was made for reading only")
        if self.host in ("", "*", "0.0.0.0", "::"):
            raise ValueError(f"kv_host {self.host!r} binds every interface; name the one readers reach")
        self._exported = _tensors(kv_caches)
        geometry = [_geometry(tensor) for tensor in self._exported]
        self._token = uuid.uuid4().hex.encode()
        socket = self._context.socket(zmq.ROUTER)
        try:
            socket.setsockopt(zmq.LINGER, 0)
            socket.setsockopt(zmq.IPV6, int(":" in self.host))
            socket.bind(f"tcp://[{self.host}]:*" if ":" in self.host else f"tcp://{self.host}:*")  # a free port
            endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            socket.close(linger=0)  # else closing the context would wait for it
            raise
        self._spawn("cadence-kv-tcp-server", lambda waker: self._serve(socket, waker))
        address = {"endpoint": endpoint, "token": self._token.decode(), "tensors": geometry}
        return KVSource(self.name, json.dumps(address, separators=(",", ":")), layout)

    def start_load(self, load: KVLoad, kv_caches: list[KVCache]) -> None:
        try:
            pending = self._prepare(load, kv_caches)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            with self._lock:
                self._results.append(KVLoadResult(load.request_id, 0, str(error)))
            return
        if pending is None:  # nothing to read
            with self._lock:
                self._results.append(KVLoadResult(load.request_id, 0))
            return
        with self._lock:
            self._loads[pending.seq] = pending
        if self._io is None:
            self._io = self._spawn("cadence-kv-tcp-reader", self._read)
        self._outbox.put(pending)
        self._io.wake()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            for pending in list(self._loads.values()):
                if pending.load.request_id == request_id:
                    pending.cancelled = True
                    if pending.state == "waiting":  # else reported when its copy ends
                        self._finish(pending, 0, "cancelled")

    def poll(self) -> list[KVLoadResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        for _, waker in self._threads:
            waker.wake()
        for thread, _ in self._threads:
            thread.join(_JOIN_S)
        if all(not thread.is_alive() for thread, _ in self._threads):
            for _, waker in self._threads:
                waker.close()
            self._context.term()  # every socket is closed: returns at once
        # A load still copying (its thread outlived the join) reports itself when done.
        self._fail(lambda pending: True, "the TCP transport closed")

    def _spawn(self, name: str, run: Any) -> _Waker:
        waker = _Waker()
        thread = threading.Thread(target=run, args=(waker,), name=name, daemon=True)
        self._threads.append((thread, waker))
        thread.start()
        return waker

    def _prepare(self, load: KVLoad, kv_caches: list[KVCache]) -> _Load | None:
        """The load to send, once it fits both caches; None if there is nothing to read."""
        source = load.source
        if not isinstance(source, KVSource) or source.transport != self.name:
            raise ValueError(f"not a TCP source: {source!r}")
        if self._closed or self._broken:
            raise ValueError(self._broken or "the TCP transport is closed")
        if not load.local_block_ids and not load.remote_block_ids:
            return None
        address = json.loads(source.address)
        endpoint, token = str(address["endpoint"]), str(address["token"]).encode()
        theirs, targets = address["tensors"], _tensors(kv_caches)
        ours = [_geometry(tensor) for tensor in targets]
        if len(theirs) != len(ours):
            raise ValueError(f"the source has {len(theirs)} KV tensors, this engine {len(ours)}")
        for index, (their, our) in enumerate(zip(theirs, ours)):
            if [their[0], *their[2:]] != [our[0], *our[2:]]:
                raise ValueError(f"KV tensor {index}: the source's blocks {their} are not like ours {our}")
        if len(load.remote_block_ids) != len(load.local_block_ids):
            raise ValueError(f"{len(load.remote_block_ids)} source blocks for {len(load.local_block_ids)} here")
        for ids, limit, side in (
            (load.remote_block_ids, theirs[0][1], "source"),
            (load.local_block_ids, ours[0][1], "local"),
        ):
            if not all(0 <= block < limit for block in ids):
                raise ValueError(f"{side} block ids out of range 0..{limit - 1}: {ids}")
        sizes = [our[0] * our[2] * len(load.local_block_ids) for our in ours]
        deadline = time.monotonic() + _TIMEOUT_S + sum(sizes) / _MIN_RATE
        return _Load(load, next(self._seq), endpoint, token, targets, sizes, deadline)

    def _finish(self, pending: _Load, num_blocks: int, error: str | None = None) -> None:
        """Report a load (under the lock); its blocks are no longer written."""
        pending.state = "done"
        del self._loads[pending.seq]
        self._results.append(KVLoadResult(pending.load.request_id, num_blocks, error))

    # ----- the exporter's server thread -----------------------------------------------
    def _serve(self, socket: zmq.Socket, waker: _Waker) -> None:
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(waker.fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                poller.poll()
                waker.drain()
                while not self._stop.is_set():
                    try:
                        identity, *request = socket.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    socket.send_multipart([identity, *self._answer(request)], copy=False)
        finally:
            socket.close(linger=0)

    def _answer(self, request: list[bytes]) -> list[Any]:
        """The reply to one read request; an error reply for anything wrong with it."""
        seq = request[0] if request else b""
        try:
            if len(request) != 3 or request[1] != self._token:
                return [seq, b"error: not a read of this export (its engine restarted?)"]
            ids = np.frombuffer(request[2], dtype="<i8")
            num_blocks = self._exported[0].shape[1] if self._exported else 0
            if ids.size and (ids.min() < 0 or ids.max() >= num_blocks):
                return [seq, f"error: block ids out of range 0..{num_blocks - 1}".encode()]
            return [seq, b"ok", *self._reply_buffers(ids)]
        except Exception as error:  # noqa: BLE001 - a bad request must not end the server
            return [seq, f"error: {type(error).__name__}: {error}".encode()]

    def _reply_buffers(self, ids: np.ndarray) -> list[np.ndarray]:
        return [_gather(tensor, ids) for tensor in self._exported]

    # ----- the reader's I/O thread ------------------------------------------------------
    def _read(self, waker: _Waker) -> None:
        sockets: dict[str, tuple[zmq.Socket, zmq.Socket]] = {}  # endpoint -> (dealer, monitor)
        poller = zmq.Poller()
        poller.register(waker.fd, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                with self._lock:
                    nearest = min((p.deadline for p in self._loads.values()), default=time.monotonic() + 1)
                events = dict(poller.poll(max(0, int((nearest - time.monotonic()) * 1000)) + 1))
                waker.drain()
                while not self._outbox.empty():
                    pending = self._outbox.get()
                    if pending.state == "waiting":  # not cancelled meanwhile
                        self._send(sockets, poller, pending)
                for endpoint, (dealer, monitor) in list(sockets.items()):
                    if dealer in events:
                        self._receive(dealer)
                    if monitor in events and self._lost(monitor):
                        self._receive(dealer)  # replies that came before the connection went
                        self._fail(
                            lambda p, e=endpoint: p.endpoint == e,
                            f"lost the connection to {endpoint} (its engine closed or died?)",
                        )
                        for closing in (monitor, dealer):
                            poller.unregister(closing)
                        dealer.disable_monitor()
                        monitor.close(linger=0)
                        dealer.close(linger=0)
                        del sockets[endpoint]
                now = time.monotonic()
                self._fail(lambda p, now=now: p.deadline <= now, "no reply from the source before the deadline")
        except Exception as error:  # a bug here must fail loads, not leave them waiting forever
            self._broken = f"the TCP transport's reader failed: {type(error).__name__}: {error}"
            raise
        finally:
            for dealer, monitor in sockets.values():
                monitor.close(linger=0)
                dealer.close(linger=0)
            self._fail(lambda p: True, self._broken or "the TCP transport closed")

    def _send(self, sockets: dict[str, tuple[zmq.Socket, zmq.Socket]], poller: zmq.Poller, pending: _Load) -> None:
        ids = np.asarray(pending.load.remote_block_ids, dtype="<i8").tobytes()
        try:
            if pending.endpoint not in sockets:
                sockets[pending.endpoint] = self._connect(pending.endpoint, poller)
            message = [pending.seq.to_bytes(8, "little"), pending.token, ids]
            sockets[pending.endpoint][0].send_multipart(message, zmq.NOBLOCK)
        except zmq.ZMQError as error:  # a malformed endpoint, or a full queue (a source not reading)
            self._fail(lambda p: p is pending, f"cannot send the read to {pending.endpoint!r}: {error}")

    def _connect(self, endpoint: str, poller: zmq.Poller) -> tuple[zmq.Socket, zmq.Socket]:
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.IPV6, 1)
        monitor = dealer.get_monitor_socket(_LOST)
        try:
            dealer.connect(endpoint)
        except zmq.ZMQError:
            dealer.disable_monitor()
            monitor.close(linger=0)
            dealer.close(linger=0)
            raise
        poller.register(dealer, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        return dealer, monitor

    @staticmethod
    def _lost(monitor: zmq.Socket) -> bool:
        lost = False
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return lost
            lost = lost or bool(event["event"] & _LOST)

    def _fail(self, which: Any, error: str) -> None:
        with self._lock:
            for pending in list(self._loads.values()):
                if pending.state == "waiting" and which(pending):
                    self._finish(pending, 0, error)

    def _receive(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frames = dealer.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            seq = int.from_bytes(frames[0].bytes, "little") if frames else 0
            with self._lock:
                pending = self._loads.get(seq)
                if pending is None or pending.state != "waiting":
                    continue  # a late reply to a load already reported: never written
                error = _reply_error(frames, pending.sizes)
                if error is not None:
                    self._finish(pending, 0, error)
                    continue
                pending.state = "copying"
            error = None
            try:
                for tensor, frame in zip(pending.targets, frames[2:]):
                    _scatter(tensor, pending.load.local_block_ids, frame.buffer)
            except Exception as raised:  # noqa: BLE001 - a failed copy fails its load, not the thread
                error = f"copying the blocks failed: {type(raised).__name__}: {raised}"
            with self._lock:
                if pending.cancelled:
                    self._finish(pending, 0, "cancelled")
                else:
                    self._finish(pending, 0 if error else len(pending.load.local_block_ids), error)


def _reply_error(frames: list[zmq.Frame], sizes: list[int]) -> str | None:
    """Why a reply cannot be written, or None: checked before any byte of it is."""
    if len(frames) < 2 or frames[1].bytes != b"ok":
        status = frames[1].bytes.decode(errors="replace") if len(frames) > 1 else "an empty reply"
        return f"the source refused the read: {status}"
    got = [len(frame) for frame in frames[2:]]
    if got != sizes:
        return f"the reply holds {got} bytes per KV tensor, {sizes} expected"
    return None
