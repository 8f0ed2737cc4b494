"""One supervised engine process beside the API server (not reached over the network):
started, read, watched, and started again when it dies.

The engine supervisor owns one when the server serves colocated, and one per engine
when prefill and decode engines run beside it. An engine knows nothing of requests: it
puts each step's outputs, its deaths and its (re)starts on the client's event queue.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

import zmq
import zmq.asyncio

from cadence.engine.engine_args import EngineArgs
from cadence.engine.protocol import EngineCoreOutputs, EngineDead, EngineReady, EngineStats, Message
from cadence.server.engine_events import EngineDied, EngineGaveUp, EngineServing, EventSink, OutputsArrived
from cadence.server.engine_handle import EngineCounters
from cadence.server.engine_process import EngineDeadError, EngineProcess

logger = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    """When a dead engine is started again, and when the server stops trying."""

    enabled: bool = True
    # Failed starts in a row (an engine that dies within `stable_after` of being ready
    # counts as one) before the server exits for its supervisor to act.
    max_failures: int = 5
    first_delay: float = 1.0
    max_delay: float = 30.0
    stable_after: float = 60.0

    def delay(self, failures: int) -> float:
        """Seconds to wait before start number `failures` (1-based) of a series."""
        return min(self.max_delay, self.first_delay * 2 ** (failures - 1))


class LocalEngine:
    """Runs one engine process at a time under `name`, restarting it by `policy`."""

    def __init__(
        self,
        name: str,
        args: EngineArgs,
        address_prefix: str,
        contexts: tuple[zmq.Context, zmq.asyncio.Context],
        policy: RestartPolicy,
        events: EventSink,
        cpus: list[int] | None = None,
    ) -> None:
        self.name = name
        self.args = args
        self.role = args.kv_role
        self.draining = False  # a local engine is stopped with the server, never drained
        self.address_prefix = f"{address_prefix}-{name}"
        self.contexts = contexts
        self.policy = policy
        self.events = events
        self.cpus = cpus
        self.info: EngineReady | None = None
        self.stats = EngineStats()
        self.counters = EngineCounters()
        self.dead_reason: str | None = None
        self.engine: EngineProcess | None = None
        self.start_timeout = 600.0
        self._generation = 0
        self._output_task: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._ready_at = 0.0
        self._next_start_at = 0.0
        self._failures = 0  # failed starts in the current series
        self._stopping = False

    # ----- lifecycle -----------------------------------------------------------------
    def spawn(self) -> None:
        """Start the engine process; `wait_ready` then waits for it."""
        self.engine = self._new_engine()

    def _new_engine(self) -> EngineProcess:
        self._generation += 1
        send_context, recv_context = self.contexts
        return EngineProcess(self.args, self.address_prefix, self._generation, send_context, recv_context, self.cpus)

    async def wait_ready(self, timeout: float) -> EngineReady:
        """Wait for the first start's EngineReady, then start reading outputs."""
        assert self.engine is not None, "spawn() first"
        self.start_timeout = timeout
        self.info = await self.engine.wait_ready(timeout)
        self._attach(self.engine)
        return self.info

    def _attach(self, engine: EngineProcess) -> None:
        loop = asyncio.get_running_loop()
        self._ready_at = loop.time()
        self.dead_reason = None
        self._output_task = asyncio.create_task(self._read_outputs(engine), name=f"cadence-{self.name}-outputs")
        loop.add_reader(engine.sentinel, self._on_process_exit, engine)

    async def _retire(self, engine: EngineProcess, timeout: float) -> None:
        asyncio.get_running_loop().remove_reader(engine.sentinel)
        if self._output_task is not None:
            self._output_task.cancel()
            self._output_task = None
        await engine.stop(timeout)

    async def shutdown(self, timeout: float) -> None:
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
            try:
                await self._restart_task
            except asyncio.CancelledError:
                pass
        if self.engine is not None:
            await self._retire(self.engine, timeout)

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and self.engine is not None and self.engine.alive

    @property
    def is_restarting(self) -> bool:
        return self._restart_task is not None and not self._restart_task.done()

    @property
    def retry_after(self) -> int:
        """Seconds until the next start, at least one."""
        if not self.is_restarting:
            return 1
        return max(1, math.ceil(self._next_start_at - asyncio.get_running_loop().time()))

    @property
    def unavailable_reason(self) -> str:
        reason = self.dead_reason or "the engine is not running"
        return f"{reason}; the engine is starting again" if self.is_restarting else reason

    def send(self, message: Message) -> None:
        """Send to the running engine; EngineDeadError when there is none."""
        if not self.is_healthy or self.engine is None:
            raise EngineDeadError(self.unavailable_reason)
        self.engine.send(message)

    # ----- restarts ------------------------------------------------------------------
    async def _restart(self) -> None:
        policy = self.policy
        loop = asyncio.get_running_loop()
        if loop.time() - self._ready_at >= policy.stable_after:
            self._failures = 0
        while True:
            self._failures += 1
            if self._failures > policy.max_failures:
                reason = f"{self.name} failed {policy.max_failures} starts in a row; last: {self.dead_reason}"
                self.dead_reason = reason
                logger.error("%s; giving up", reason)
                self.events(EngineGaveUp(self, reason))
                return
            delay = policy.delay(self._failures)
            self._next_start_at = loop.time() + delay
            tries = f"try {self._failures} of {policy.max_failures}"
            logger.warning("%s; starting it again in %.0f s (%s)", self.dead_reason, delay, tries)
            await asyncio.sleep(delay)
            assert self.engine is not None
            try:
                await self._retire(self.engine, timeout=5.0)
                self.engine = self._new_engine()
                self.info = await self.engine.wait_ready(self.start_timeout)
            except Exception as error:  # noqa: BLE001 - any failure to start is a failed start, counted
                self.dead_reason = f"{self.name} failed to start again: {error}"
                continue
            self.counters.restarts += 1
            self._attach(self.engine)
            logger.warning("%s is serving again (restart %d)", self.name, self.counters.restarts)
            self.events(EngineServing(self))
            return

    # ----- outputs and death ---------------------------------------------------------
    async def _read_outputs(self, engine: EngineProcess) -> None:
        try:
            while True:
                message = await engine.recv()
                if isinstance(message, EngineCoreOutputs):
                    self.stats = message.stats
                    self.events(OutputsArrived(self, message))
                elif isinstance(message, EngineDead):
                    self._die(message.message)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # without this task nothing is served
            logger.exception("reading %s's outputs failed", self.name)
            self._die(f"reading {self.name}'s outputs failed: {error!r}")

    def _on_process_exit(self, engine: EngineProcess) -> None:
        asyncio.get_running_loop().remove_reader(engine.sentinel)
        if not self._stopping and engine is self.engine:
            engine.process.join(1.0)  # its sentinel says it ended: this reaps it, for the exit code
            self._die(f"the {self.name} process exited unexpectedly (exit code {engine.process.exitcode})")

    def fail(self, reason: str) -> None:
        """The client could not handle this engine's outputs: end it as if it died."""
        self._die(reason)

    def _die(self, reason: str) -> None:
        """Report the death, show the engine idle, and start it again if allowed."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        # What the dead engine left queued belongs to requests the client fails: stop reading.
        if self._output_task is not None and self._output_task is not asyncio.current_task():
            self._output_task.cancel()
        self._output_task = None
        self.counters.steps_before += self.stats.num_steps
        self.counters.preemptions_before += self.stats.num_preemptions
        self.stats = EngineStats()
        self.events(EngineDied(self, reason))
        if self.policy.enabled and not self._stopping and not self.is_restarting:
            self._restart_task = asyncio.create_task(self._restart(), name=f"cadence-{self.name}-restart")
