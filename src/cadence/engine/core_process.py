"""The EngineCore in its own process, driven over ZMQ.

The server binds two sockets and starts this process, which connects to them: it PULLs
requests and aborts, and PUSHes one `EngineCoreOutputs` per step. The loop never waits
while there is work, and sleeps on the input socket when there is none, so an idle
engine costs nothing and the HTTP event loop in the other process is never blocked by a
forward pass.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

from cadence.engine.engine_args import EngineArgs
from cadence.engine.log_format import configure_logging
from cadence.engine.parent_death import die_with_parent
from cadence.engine.process_name import ROLE_NAMES, name_this_process
from cadence.engine.protocol import (
    AbortRequests,
    CancelKVWait,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    ExtendKVWait,
    LoadKV,
    Message,
    ReleaseKV,
    Shutdown,
    decode,
    encode,
)

if TYPE_CHECKING:
    from cadence.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)

# How long an idle engine sleeps on its input before checking that its parent lives.
_IDLE_POLL_MS = 500
# How often an engine with nothing else to do looks whether a grammar finished compiling.
_GRAMMAR_POLL_MS = 2


@dataclass
class EngineAddresses:
    """The ZMQ endpoints the front end bound: requests flow in, outputs flow out."""

    inputs: str
    outputs: str


class EngineCoreLoop:
    """Applies incoming messages to an EngineCore and steps it while work remains."""

    def __init__(self, core: EngineCore, inputs: zmq.Socket, outputs: zmq.Socket) -> None:
        self.core = core
        self.inputs = inputs
        self.outputs = outputs
        self.parent_pid = os.getppid()
        self.stopping = False
        self._rejected: dict[str, str] = {}

    def run(self) -> None:
        while not self.stopping:
            received = self._drain_inputs(wait_ms=0 if self.core.has_work() else self._idle_wait_ms())
            if os.getppid() != self.parent_pid:
                return  # the server died without telling us; nobody reads our outputs
            if self.core.has_work():
                outputs = self.core.step()
                self._send_outputs(outputs)
                continue
            # Prompt KV parked or held for another engine is not work, but has deadlines.
            expired = self.core.expire_kv_deadlines()
            if self.core.has_work():
                continue
            if received or expired:
                # Idle, but aborts, rejections, KV messages or expiries changed the gauges.
                self._send_outputs([])

    def _idle_wait_ms(self) -> int:
        """Sleep on the input socket until the next KV deadline, or the idle poll; only
        briefly while a grammar compiles (its thread cannot wake the socket)."""
        if self.core.structured.num_held:
            return _GRAMMAR_POLL_MS
        deadline = self.core.next_kv_deadline()
        if deadline is None:
            return _IDLE_POLL_MS
        return max(1, min(_IDLE_POLL_MS, int((deadline - time.monotonic()) * 1000) + 1))

    def _drain_inputs(self, wait_ms: int) -> bool:
        received = False
        timeout = wait_ms
        while self.inputs.poll(timeout):
            self._handle(decode(self.inputs.recv()))
            received = True
            timeout = 0
        return received

    def _handle(self, message: Message) -> None:
        if isinstance(message, EngineCoreRequest):
            try:
                self.core.add_request(message)
            except ValueError as error:
                # The front end validates first; this catches what only the engine knows.
                self._rejected[message.request_id] = str(error)
                logger.warning("%s: refused: %s", message.request_id, error)
        elif isinstance(message, AbortRequests):
            self.core.abort_requests(message.request_ids)
            for request_id, index in message.sequences:
                if self.core.has_sequence(request_id, index):
                    self.core.abort_requests([self.core.sequence_id(request_id, index)])
        elif isinstance(message, LoadKV):
            self.core.start_kv_load(message.request_id, message.source, message.block_ids)
        elif isinstance(message, ReleaseKV):
            self.core.release_sent_kv(message.request_ids)
        elif isinstance(message, CancelKVWait):
            self.core.cancel_kv_wait(message.request_ids, message.reason, message.chunk_tokens)
        elif isinstance(message, ExtendKVWait):
            self.core.extend_kv_wait(message.request_ids)
        elif isinstance(message, Shutdown):
            self.stopping = True
        else:
            raise TypeError(f"the engine cannot handle {type(message).__name__}")

    def _send_outputs(self, outputs: list) -> None:
        events = self.core.take_kv_events()
        self._rejected.update(self.core.take_failed_requests())
        message = EngineCoreOutputs(
            outputs,
            self.core.stats(),
            self._rejected,
            events.reserved,
            events.prefilled,
            events.loaded,
            self.core.step_recorder.take(),
        )
        self._rejected = {}
        self.outputs.send(encode(message), copy=False)


def run_engine_core(
    args: EngineArgs,
    addresses: EngineAddresses,
    log_level: int = logging.WARNING,
    cpus: list[int] | None = None,
    log_format: str = "text",
) -> None:
    """Process entry point: build the engine, say it is ready, and serve until told to stop.

    ``log_level`` and ``log_format`` are the server's: what loading decides (the CPU kernels, the quantized
    layers) is logged from this process. ``cpus`` pins the engine, and its torch threads
    (one per CPU), to those CPUs, so that engines sharing a host do not share cores."""
    # Imported here, not at the top: the server imports this module to name the process's
    # target, and torch and the engine must load in the engine process alone.
    import torch

    from cadence.engine.engine_core import EngineCore

    die_with_parent()
    name_this_process(ROLE_NAMES[args.kv_role])
    if cpus:
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(len(cpus))
    configure_logging(log_level, log_format)
    # Ctrl-C reaches the whole process group; the server decides when the engine stops.
    # SIGTERM and SIGHUP too: a process-group kill (systemd's default KillMode) or a
    # closing terminal would otherwise end the engine mid-step while the server drains;
    # it stops on Shutdown, or dies with the server (engine/parent_death.py).
    for ignored in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(ignored, signal.SIG_IGN)
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.connect(addresses.inputs)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 2000)
    outputs.connect(addresses.outputs)
    try:
        core = EngineCore(args)
        try:
            outputs.send(encode(core.ready_message()))
            EngineCoreLoop(core, inputs, outputs).run()
        finally:
            core.close()
    except Exception as error:  # reported to the server, then we exit
        detail = "".join(traceback.format_exception_only(type(error), error)).strip()
        traceback.print_exc()
        outputs.send(encode(EngineDead(f"the engine failed: {detail}")))
        raise SystemExit(1) from error
    finally:
        inputs.close(linger=0)
        outputs.close()
        context.term()
