"""The server's handle on the EngineCore process: start it, feed it, fan out its outputs,
and start it again when it dies.

All front-end work that is not the HTTP protocol lives here: one asyncio task reads the
engine's per-step outputs, runs the `OutputProcessor` (detokenization, stop strings,
logprob dicts) and wakes the `RequestStream` of every request that changed. Handlers
only ever await their own stream, so a slow client never delays anyone else.

When the engine process dies, what was in flight fails (503, or an error event), and
the engine is started again after a backoff (`RestartPolicy`); until it is ready, new
requests get 503 with Retry-After. Starts that keep failing end the server (`on_fatal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from cadence.engine.engine_args import EngineArgs
from cadence.engine.output_processor import OutputProcessor
from cadence.engine.outputs import RequestOutput
from cadence.engine.protocol import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineDead,
    EngineReady,
    EngineStats,
)
from cadence.server.engine_process import EngineDeadError, EngineProcess

logger = logging.getLogger(__name__)

__all__ = ["AsyncEngineClient", "EngineDeadError", "EngineOverloadedError", "RequestRejectedError", "RequestStream"]


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class RequestRejectedError(ValueError):
    """The engine refused one request (the front end's checks let it through)."""


class RequestStream:
    """One request's view of the engine.

    `output` is updated in place by the client's output task, which then sets `changed`
    (an event several streams may share). A handler reads `output` right after the event
    fires, before awaiting anything else, so it always sees one consistent step.
    """

    def __init__(
        self, client: AsyncEngineClient, output: RequestOutput, processor: OutputProcessor, changed: asyncio.Event
    ) -> None:
        self._client = client
        self._processor = processor
        self.output = output
        self.changed = changed
        self._error: Exception | None = None

    @property
    def request_id(self) -> str:
        return self.output.request_id

    def _notify(self, error: Exception | None = None) -> None:
        if error is not None and self._error is None:
            self._error = error
        self.changed.set()

    def raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def streamable_text_length(self, index: int) -> int:
        """How much of choice `index`'s text may be sent: a stop string may start past it."""
        completion = self.output.outputs[index]
        if completion.finished:
            return len(completion.text)
        return len(completion.text) - self._processor.held_back(self.request_id, index)

    def abort(self) -> None:
        """Stop the request in the engine (freeing its KV blocks) unless it already finished."""
        if not self.output.finished:
            self._client.abort(self.request_id)


@dataclass
class RequestCounters:
    """Running totals for /metrics."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    engine_restarts: int = 0
    # Engine counters of engines that died, so the exported totals never go back.
    steps_before: int = 0
    preemptions_before: int = 0


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


@dataclass
class _InFlight:
    stream: RequestStream
    num_sequences: int


class AsyncEngineClient:
    """Starts the EngineCore process and talks to it over ZMQ with msgpack."""

    def __init__(
        self,
        max_waiting: int,
        restart: RestartPolicy | None = None,
        on_fatal: Callable[[str], None] | None = None,
    ) -> None:
        self.processor = OutputProcessor(tokenizer=None)  # wait_ready() sets the tokenizer
        self.max_waiting = max_waiting
        self.restart_policy = restart or RestartPolicy()
        self.on_fatal = on_fatal
        self.info: EngineReady | None = None
        self.stats = EngineStats()
        self.counters = RequestCounters()
        self.dead_reason: str | None = None
        self._in_flight: dict[str, _InFlight] = {}
        self._num_sequences = 0
        self._socket_dir = tempfile.mkdtemp(prefix="cadence-")
        self._send_context = zmq.Context()
        self._context = zmq.asyncio.Context()
        self._args: EngineArgs | None = None
        self._engine: EngineProcess | None = None
        self._generation = 0
        self._start_timeout = 600.0
        self._output_task: asyncio.Task[None] | None = None
        self._restart_task: asyncio.Task[None] | None = None
        self._ready_at = 0.0
        self._next_start_at = 0.0
        self._failures = 0  # failed starts in the current series
        self._stopping = False

    # ----- lifecycle -----------------------------------------------------------------
    def spawn(self, args: EngineArgs) -> None:
        """Bind the sockets and start the engine process; `wait_ready` then waits for it.

        Split in two so the server can load its tokenizer while the engine loads the model.
        """
        self._args = args
        self._engine = self._new_engine()

    def _new_engine(self) -> EngineProcess:
        assert self._args is not None
        self._generation += 1
        return EngineProcess(self._args, self._socket_dir, self._generation, self._send_context, self._context)

    async def wait_ready(self, timeout: float, tokenizer: PreTrainedTokenizerBase | None) -> EngineReady:
        """Wait for the engine's first EngineReady, then start reading its outputs."""
        assert self._engine is not None, "spawn() first"
        self.processor.tokenizer = tokenizer
        self._start_timeout = timeout
        self.info = await self._engine.wait_ready(timeout)
        logger.info(
            "engine ready on %s (%s): %d KV blocks, max_model_len %d, max_num_seqs %d",
            self.info.device,
            self.info.dtype,
            self.info.num_kv_blocks,
            self.info.max_model_len,
            self.info.max_num_seqs,
        )
        self._attach(self._engine)
        return self.info

    def _attach(self, engine: EngineProcess) -> None:
        """Serve from a ready engine: read its outputs and watch for its exit."""
        loop = asyncio.get_running_loop()
        self._ready_at = loop.time()
        self.dead_reason = None
        self._output_task = asyncio.create_task(self._read_outputs(engine), name="cadence-engine-outputs")
        loop.add_reader(engine.sentinel, self._on_process_exit, engine)

    async def _retire(self, engine: EngineProcess, timeout: float) -> None:
        """Stop reading from an engine, stop it if it still runs, and close its sockets."""
        asyncio.get_running_loop().remove_reader(engine.sentinel)
        if self._output_task is not None:
            self._output_task.cancel()
            self._output_task = None
        await engine.stop(timeout)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the engine to stop, wait for it, and kill it if it will not."""
        self._stopping = True
        if self._restart_task is not None:
            self._restart_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._restart_task
        if self._engine is not None:
            await self._retire(self._engine, timeout)
        self._send_context.term()
        self._context.term()
        os.rmdir(self._socket_dir)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and self._engine is not None and self._engine.alive

    @property
    def is_restarting(self) -> bool:
        return self._restart_task is not None and not self._restart_task.done()

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait: until the next start, at least one."""
        if not self.is_restarting:
            return 1
        return max(1, math.ceil(self._next_start_at - asyncio.get_running_loop().time()))

    @property
    def unavailable_reason(self) -> str:
        """Why requests are refused now (only meaningful while not healthy)."""
        reason = self.dead_reason or "the engine is not running"
        return f"{reason}; the engine is starting again" if self.is_restarting else reason

    # ----- restarts ------------------------------------------------------------------
    async def _restart(self) -> None:
        """Start the engine again, with backoff, until it is ready or the policy gives up."""
        policy = self.restart_policy
        loop = asyncio.get_running_loop()
        if loop.time() - self._ready_at >= policy.stable_after:
            self._failures = 0
        while True:
            self._failures += 1
            if self._failures > policy.max_failures:
                self._give_up(f"the engine failed {policy.max_failures} starts in a row; last: {self.dead_reason}")
                return
            delay = policy.delay(self._failures)
            self._next_start_at = loop.time() + delay
            logger.warning(
                "%s; starting it again in %.0f s (try %d of %d)",
                self.dead_reason,
                delay,
                self._failures,
                policy.max_failures,
            )
            await asyncio.sleep(delay)
            assert self._engine is not None
            try:
                await self._retire(self._engine, timeout=5.0)
                self._engine = self._new_engine()
                self.info = await self._engine.wait_ready(self._start_timeout)
            except Exception as error:  # noqa: BLE001 - any failure to start is a failed start, counted
                self.dead_reason = f"the engine failed to start again: {error}"
                continue
            self.counters.engine_restarts += 1
            self._attach(self._engine)
            logger.warning("the engine is serving again (restart %d)", self.counters.engine_restarts)
            return

    def _give_up(self, reason: str) -> None:
        self.dead_reason = reason
        logger.error("%s; giving up", reason)
        if self.on_fatal is not None:
            self.on_fatal(reason)

    # ----- requests ------------------------------------------------------------------
    @property
    def max_sequences(self) -> int:
        """The most sequences in flight at once: running plus waiting."""
        assert self.info is not None
        return self.info.max_num_seqs + self.max_waiting

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, changed: asyncio.Event | None = None
    ) -> RequestStream:
        """Queue a request; raise EngineDeadError or EngineOverloadedError instead of queuing."""
        if not self.is_healthy:
            raise EngineDeadError(self.unavailable_reason)
        assert self.info is not None and self._engine is not None
        num_sequences = request.sampling_params.n
        if self._num_sequences + num_sequences > self.max_sequences:
            raise EngineOverloadedError(
                f"the server is full: {self._num_sequences} sequences are in flight "
                f"(max_num_seqs {self.info.max_num_seqs} + max_waiting {self.max_waiting})"
            )
        self.processor.add_request(request.request_id, prompt, request.prompt_token_ids, request.sampling_params)
        try:
            # Sent before any other bookkeeping: a value msgpack cannot carry leaves no trace.
            self._engine.send(request)
        except Exception:
            self.processor.abort(request.request_id)
            raise
        output = self.processor.states[request.request_id].output
        stream = RequestStream(self, output, self.processor, changed or asyncio.Event())
        self._in_flight[request.request_id] = _InFlight(stream, num_sequences)
        self._num_sequences += num_sequences
        self.counters.prompt_tokens += len(request.prompt_token_ids)
        return stream

    def abort(self, request_id: str) -> None:
        entry = self._release(request_id)
        if entry is None:
            return
        self.processor.abort(request_id)
        self._count_finished("abort", entry.num_sequences)
        if self.is_healthy and self._engine is not None:
            # An engine that is gone frees everything anyway; its exit is handled on its own.
            with contextlib.suppress(EngineDeadError):
                self._engine.send(AbortRequests(request_ids=[request_id]))

    def _release(self, request_id: str) -> _InFlight | None:
        entry = self._in_flight.pop(request_id, None)
        if entry is not None:
            self._num_sequences -= entry.num_sequences
        return entry

    def _count_finished(self, reason: str, num_sequences: int = 1) -> None:
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + num_sequences

    # ----- outputs -------------------------------------------------------------------
    async def _read_outputs(self, engine: EngineProcess) -> None:
        try:
            while True:
                message = await engine.recv()
                if isinstance(message, EngineCoreOutputs):
                    self._apply(engine, message)
                elif isinstance(message, EngineDead):
                    self._die(message.message)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # without this task nothing is served
            logger.exception("processing engine outputs failed")
            self._die(f"processing engine outputs failed: {error!r}")

    def _apply(self, engine: EngineProcess, message: EngineCoreOutputs) -> None:
        self.stats = message.stats
        for request_id, reason in message.rejected.items():
            entry = self._release(request_id)
            self.processor.abort(request_id)
            if entry is not None:
                entry.stream._notify(RequestRejectedError(reason))
        finished, to_abort = self.processor.process(message.outputs)
        self.counters.generation_tokens += sum(len(o.new_token_ids) for o in message.outputs)
        for output in finished:
            for completion in output.outputs:
                self._count_finished(completion.finish_reason or "abort")
        if to_abort:
            with contextlib.suppress(EngineDeadError):
                engine.send(AbortRequests(sequences=to_abort))
        for request_id in {o.request_id for o in message.outputs}:
            entry = self._in_flight.get(request_id)
            if entry is None:
                continue
            if entry.stream.output.finished:
                self._release(request_id)
            entry.stream._notify()

    def _on_process_exit(self, engine: EngineProcess) -> None:
        asyncio.get_running_loop().remove_reader(engine.sentinel)
        if not self._stopping and engine is self._engine:
            engine.process.join(1.0)  # its sentinel says it ended: this reaps it, for the exit code
            self._die(f"the engine process exited unexpectedly (exit code {engine.process.exitcode})")

    def _die(self, reason: str) -> None:
        """Fail what was in flight, show the engine idle, and start it again if allowed."""
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        logger.error("%s", reason)
        # What the dead engine left queued is for requests failed below: stop reading it.
        if self._output_task is not None and self._output_task is not asyncio.current_task():
            self._output_task.cancel()
        self._output_task = None
        self._fail_all(EngineDeadError(reason))
        self.counters.steps_before += self.stats.num_steps
        self.counters.preemptions_before += self.stats.num_preemptions
        self.stats = EngineStats()
        if self.restart_policy.enabled and not self._stopping and not self.is_restarting:
            self._restart_task = asyncio.create_task(self._restart(), name="cadence-engine-restart")

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._in_flight):
            entry = self._release(request_id)
            self.processor.abort(request_id)
            if entry is not None:
                entry.stream._notify(error)
