"""The server's handle on the EngineCore process: start it, feed it, and fan out its outputs.

All front-end work that is not the HTTP protocol lives here: one asyncio task reads the
engine's per-step outputs, runs the `OutputProcessor` (detokenization, stop strings,
logprob dicts) and wakes the `RequestStream` of every request that changed. Handlers
only ever await their own stream, so a slow client never delays anyone else.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import tempfile
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from transformers import PreTrainedTokenizerBase

from cadence.engine.core_process import EngineAddresses, run_engine_core
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
    Shutdown,
    decode,
    encode,
)

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine process is gone; nothing more can be served."""


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


@dataclass
class _InFlight:
    stream: RequestStream
    num_sequences: int


class AsyncEngineClient:
    """Starts the EngineCore process and talks to it over ZMQ with msgpack."""

    def __init__(self, max_waiting: int) -> None:
        self.processor = OutputProcessor(tokenizer=None)  # wait_ready() sets the tokenizer
        self.max_waiting = max_waiting
        self.info: EngineReady | None = None
        self.stats = EngineStats()
        self.counters = RequestCounters()
        self.dead_reason: str | None = None
        self._in_flight: dict[str, _InFlight] = {}
        self._num_sequences = 0
        self._socket_dir = tempfile.mkdtemp(prefix="cadence-")
        # A plain (blocking-API) socket for sends: with no high-water mark a send never
        # waits, and an error is raised right here instead of in a Future nobody reads.
        self._send_context = zmq.Context()
        self._inputs = self._send_context.socket(zmq.PUSH)
        self._context = zmq.asyncio.Context()
        self._outputs = self._context.socket(zmq.PULL)
        # No high-water marks: admission control bounds the traffic, and a send must
        # never wait or drop (an abort that waited could arrive after its request ended).
        self._inputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs.setsockopt(zmq.RCVHWM, 0)
        self._process: multiprocessing.process.BaseProcess | None = None
        self._output_task: asyncio.Task[None] | None = None
        self._stopping = False

    # ----- lifecycle -----------------------------------------------------------------
    def spawn(self, args: EngineArgs) -> None:
        """Bind the sockets and start the engine process; `wait_ready` then waits for it.

        Split in two so the server can load its tokenizer while the engine loads the model.
        """
        addresses = EngineAddresses(
            inputs=f"ipc://{self._socket_dir}/inputs", outputs=f"ipc://{self._socket_dir}/outputs"
        )
        self._inputs.bind(addresses.inputs)
        self._outputs.bind(addresses.outputs)
        # spawn, not fork: the engine must not inherit this process's event loop and threads.
        context = multiprocessing.get_context("spawn")
        self._process = context.Process(
            target=run_engine_core,
            args=(args, addresses, logging.getLogger().getEffectiveLevel()),
            name="cadence-engine-core",
            daemon=True,
        )
        self._process.start()

    async def wait_ready(self, timeout: float, tokenizer: PreTrainedTokenizerBase | None) -> EngineReady:
        """Wait for the engine's EngineReady, then start reading its outputs."""
        assert self._process is not None, "spawn() first"
        self.processor.tokenizer = tokenizer
        self.info = await self._wait_ready(timeout)
        logger.info(
            "engine ready on %s (%s): %d KV blocks, max_model_len %d, max_num_seqs %d",
            self.info.device,
            self.info.dtype,
            self.info.num_kv_blocks,
            self.info.max_model_len,
            self.info.max_num_seqs,
        )
        self._output_task = asyncio.create_task(self._read_outputs(), name="cadence-engine-outputs")
        asyncio.get_running_loop().add_reader(self._process.sentinel, self._on_process_exit)
        return self.info

    async def _wait_ready(self, timeout: float) -> EngineReady:
        assert self._process is not None
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            if await self._outputs.poll(200):
                message = decode(await self._outputs.recv())
                if isinstance(message, EngineReady):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineDeadError(message.message)
                raise EngineDeadError(f"unexpected first message {type(message).__name__}")
            if not self._process.is_alive():
                raise EngineDeadError(f"the engine process exited with code {self._process.exitcode} while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise EngineDeadError(f"the engine did not start within {timeout:.0f} s")

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the engine to stop, wait for it, and kill it if it will not."""
        self._stopping = True
        process = self._process
        if process is not None and process.is_alive():
            self._inputs.send(encode(Shutdown()))
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, process.join, timeout)
            if process.is_alive():
                process.kill()
                await loop.run_in_executor(None, process.join, 5.0)
        if process is not None:
            asyncio.get_running_loop().remove_reader(process.sentinel)
        if self._output_task is not None:
            self._output_task.cancel()
        self._inputs.close(linger=0)
        self._outputs.close(linger=0)
        self._send_context.term()
        self._context.term()
        for name in ("inputs", "outputs"):
            try:
                os.unlink(os.path.join(self._socket_dir, name))
            except FileNotFoundError:
                pass
        os.rmdir(self._socket_dir)
        self._fail_all(EngineDeadError("the server is shutting down"))

    @property
    def is_healthy(self) -> bool:
        return self.dead_reason is None and self._process is not None and self._process.is_alive()

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
            raise EngineDeadError(self.dead_reason or "the engine is not running")
        assert self.info is not None
        num_sequences = request.sampling_params.n
        if self._num_sequences + num_sequences > self.max_sequences:
            raise EngineOverloadedError(
                f"the server is full: {self._num_sequences} sequences are in flight "
                f"(max_num_seqs {self.info.max_num_seqs} + max_waiting {self.max_waiting})"
            )
        # Encode before any bookkeeping: a value msgpack cannot carry must leave no trace.
        message = encode(request)
        self.processor.add_request(request.request_id, prompt, request.prompt_token_ids, request.sampling_params)
        output = self.processor.states[request.request_id].output
        stream = RequestStream(self, output, self.processor, changed or asyncio.Event())
        self._in_flight[request.request_id] = _InFlight(stream, num_sequences)
        self._num_sequences += num_sequences
        self.counters.prompt_tokens += len(request.prompt_token_ids)
        self._inputs.send(message)
        return stream

    def abort(self, request_id: str) -> None:
        entry = self._release(request_id)
        if entry is None:
            return
        self.processor.abort(request_id)
        self._count_finished("abort", entry.num_sequences)
        if self.is_healthy:
            self._inputs.send(encode(AbortRequests(request_ids=[request_id])))

    def _release(self, request_id: str) -> _InFlight | None:
        entry = self._in_flight.pop(request_id, None)
        if entry is not None:
            self._num_sequences -= entry.num_sequences
        return entry

    def _count_finished(self, reason: str, num_sequences: int = 1) -> None:
        self.counters.finished[reason] = self.counters.finished.get(reason, 0) + num_sequences

    # ----- outputs -------------------------------------------------------------------
    async def _read_outputs(self) -> None:
        try:
            while True:
                message = decode(await self._outputs.recv())
                if isinstance(message, EngineCoreOutputs):
                    self._apply(message)
                elif isinstance(message, EngineDead):
                    self._die(message.message)
                    return
        except asyncio.CancelledError:
            raise
        except Exception as error:  # without this task nothing is served
            logger.exception("processing engine outputs failed")
            self._die(f"processing engine outputs failed: {error!r}")

    def _apply(self, message: EngineCoreOutputs) -> None:
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
            self._inputs.send(encode(AbortRequests(sequences=to_abort)))
        for request_id in {o.request_id for o in message.outputs}:
            entry = self._in_flight.get(request_id)
            if entry is None:
                continue
            if entry.stream.output.finished:
                self._release(request_id)
            entry.stream._notify()

    def _on_process_exit(self) -> None:
        assert self._process is not None
        asyncio.get_running_loop().remove_reader(self._process.sentinel)
        if not self._stopping:
            self._die(f"the engine process exited unexpectedly (code {self._process.exitcode})")

    def _die(self, reason: str) -> None:
        if self.dead_reason is None:
            self.dead_reason = reason
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, error: Exception) -> None:
        for request_id in list(self._in_flight):
            entry = self._release(request_id)
            self.processor.abort(request_id)
            if entry is not None:
                entry.stream._notify(error)
