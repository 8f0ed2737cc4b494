"""The server's handle on its engine processes: start them, feed them, fan out their
outputs, and start them again when they die.

All front-end work that is not the HTTP protocol lives here: each engine's output task
(server/engine_slot.py) hands its per-step outputs to the `OutputProcessor`
(detokenization, stop strings, logprob dicts), and the `RequestStream` of every request
that changed is woken. Handlers only ever await their own stream, so a slow client never
delays anyone else.

Colocated, there is one engine. Disaggregated (`Topology`), there are prefill and decode
engines, and a `Coordinator` (server/disaggregation/coordinator.py) routes each request:
outputs come from decode engines, KV events from all of them. A dead prefill engine
costs no request (its prompts are computed elsewhere); a dead decode engine fails the
requests it held. Either way the engine is started again after a backoff
(`RestartPolicy`) and re-admitted. While no engine can take a request, new requests get
503 with Retry-After; starts that keep failing end the server (`on_fatal`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

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
    EngineReady,
    EngineStats,
    Message,
)
from cadence.server.disaggregation.coordinator import Coordinator, NoEngineError
from cadence.server.disaggregation.remote_slot import RemoteSlot
from cadence.server.disaggregation.topology import LinkTiming, Topology, WorkerList, split_cpus
from cadence.server.disaggregation.worker_link import WorkerLink
from cadence.server.engine_process import EngineDeadError
from cadence.server.engine_slot import EngineSlot, RestartPolicy, Slot
from cadence.server.ipc_addresses import address_prefix
from cadence.server.leftover_sockets import remove_dead_socket_folders
from cadence.server.request_log import log_finished
from cadence.server.request_metrics import RequestMetrics

logger = logging.getLogger(__name__)

__all__ = [
    "AsyncEngineClient",
    "EngineDeadError",
    "EngineOverloadedError",
    "RequestRejectedError",
    "RequestStream",
    "RestartPolicy",
    "Topology",
    "WorkerList",
]


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
class _InFlight:
    stream: RequestStream
    num_sequences: int
    engine: str  # the slot that serves its outputs


class AsyncEngineClient:
    """Starts the engine processes and talks to them over ZMQ with msgpack."""

    def __init__(
        self,
        max_waiting: int,
        restart: RestartPolicy | None = None,
        on_fatal: Callable[[str], None] | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.processor = OutputProcessor(tokenizer=None)  # wait_ready() sets the tokenizer
        self.max_waiting = max_waiting
        self.restart_policy = restart or RestartPolicy()
        self.on_fatal = on_fatal
        self.topology = topology or Topology()
        self.info: EngineReady | None = None
        self.metrics = RequestMetrics(max_model_len=0)  # wait_ready() sets the length
        self.log_prompts = False  # prompt and output text in the per-request log lines
        self.slots: dict[str, Slot] = {}
        self.coordinator: Coordinator | None = None
        self.link: WorkerLink | None = None  # a worker's: routers elsewhere drive its engine
        self.workers: WorkerList | None = None  # a router's: it drives engines elsewhere
        self._link_timing = LinkTiming()
        self._decode_ready = asyncio.Event()
        # Work shutdown waits for: workers no longer listed, being let go; the sweep of
        # dead servers' socket folders.
        self._tasks: set[asyncio.Task[None]] = set()
        self._follow_task: asyncio.Task[None] | None = None
        self._in_flight: dict[str, _InFlight] = {}
        self._num_sequences = 0
        self._address_prefix = address_prefix()
        self._contexts = (zmq.Context(), zmq.asyncio.Context())
        self._stopping = False
        # Past the shutdown deadline: makes the error every request gets instead of an answer.
        self._refusal: Callable[[], Exception] | None = None

    # ----- lifecycle -----------------------------------------------------------------
    def spawn(self, args: EngineArgs) -> None:
        """Start every engine process; `wait_ready` then waits for them.

        Split in two so the server can load its tokenizer while the engines load the model.
        """
        engines = self.topology.engines(args)
        cpus = split_cpus(list(engines))
        for name, engine_args in engines.items():
            policy = self.restart_policy
            slot = EngineSlot(name, engine_args, self._address_prefix, self._contexts, policy, self, cpus[name])
            self.slots[name] = slot
            slot.spawn()
        # While the engines load: the sweep pauses a moment when it finds a suspect.
        self._start_task(self._remove_leftovers(), "cadence-remove-leftovers")
        if self.topology.disaggregated:
            self.coordinator = Coordinator(self._send, self.topology.placement)

    @staticmethod
    async def _remove_leftovers() -> None:
        """Remove the socket folders of dead servers of older versions (this one leaves none)."""
        await asyncio.to_thread(remove_dead_socket_folders)

    def connect(self, workers: WorkerList, timing: LinkTiming) -> None:
        """Be a router: drive the engines of workers on other hosts, and follow their list.
        `wait_ready` then waits for the first decode worker; the others join as they answer."""
        self.workers, self._link_timing = workers, timing
        self.coordinator = Coordinator(self._send, self.topology.placement)
        self.update_workers(workers.current())
        self._follow_task = asyncio.create_task(self._follow_worker_list(), name="cadence-worker-list")

    async def wait_ready(self, timeout: float, tokenizer: PreTrainedTokenizerBase | None) -> EngineReady:
        """Wait for every engine's first EngineReady, then start reading their outputs."""
        assert self.slots or self.workers is not None, "spawn() or connect() first"
        self.processor.tokenizer = tokenizer
        if self.workers is not None:
            try:
                await asyncio.wait_for(self._decode_ready.wait(), timeout)
            except TimeoutError:
                reasons = "; ".join(slot.unavailable_reason for slot in self.slots.values())
                raise EngineDeadError(f"no decode worker was ready within {timeout:g} s: {reasons}") from None
            assert self.info is not None
            self.metrics.max_model_len = self.info.max_model_len
            return self.info
        readies = await asyncio.gather(*(slot.wait_ready(timeout) for slot in self.slots.values()))
        for slot, info in zip(self.slots.values(), readies):
            logger.info(
                "%s ready on %s (%s): %d KV blocks, max_model_len %d, max_num_seqs %d",
                slot.name,
                info.device,
                info.dtype,
                info.num_kv_blocks,
                info.max_model_len,
                info.max_num_seqs,
            )
            if self.coordinator is not None:
                self.coordinator.add_engine(slot.name, info)
        self.info = readies[-1]  # a decode engine's when disaggregated: it serves the requests
        self.metrics.max_model_len = self.info.max_model_len
        return self.info

    async def drain_link(self, timeout: float) -> None:
        """A worker that is stopping: routers send nothing new; wait for what they sent."""
        if self.link is not None:
            await self.link.drain(timeout)

    def open_link(self, address: str, timing: LinkTiming) -> WorkerLink:
        """Be a worker: let routers on other hosts drive this server's one engine."""
        (slot,) = self.slots.values()
        assert self.info is not None, "wait_ready() first"
        self.link = WorkerLink(self._contexts[1], address, slot.send, timing)
        self.link.on_engine_ready(self.info)
        self.link.start()
        return self.link

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the engines to stop, wait for them, and kill any that will not."""
        self._stopping = True
        if self._follow_task is not None:
            self._follow_task.cancel()
        if self.link is not None:
            await self.link.close()
        # Workers no longer listed are still being let go: their sockets must close first.
        await asyncio.gather(*self._tasks, *(slot.shutdown(timeout) for slot in self.slots.values()))
        for context in self._contexts:
            context.destroy(linger=0)
        self._fail(list(self._in_flight), EngineDeadError("the server is shutting down"))

    def _serving_slots(self) -> list[Slot]:
        """The slots whose engines take requests: every decode engine a router (or this
        server) routes to, or the one engine (a worker's, whatever its role)."""
        if self.coordinator is None:
            return list(self.slots.values())
        return [slot for slot in self.slots.values() if slot.role != "prefill"]

    @property
    def is_healthy(self) -> bool:
        """Whether a request can be served now (a dead prefill engine does not stop that)."""
        return any(slot.is_healthy for slot in self._serving_slots())

    @property
    def is_restarting(self) -> bool:
        return any(slot.is_restarting for slot in self._serving_slots())

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait: until the next engine start, at least one."""
        waits = [slot.retry_after for slot in self._serving_slots() if slot.is_restarting]
        return min(waits, default=1)

    @property
    def unavailable_reason(self) -> str:
        """Why requests are refused now (only meaningful while not healthy)."""
        return "; ".join(slot.unavailable_reason for slot in self._serving_slots())

    @property
    def stats(self) -> EngineStats:
        """The gauges of the engines that serve requests, summed (usage averaged)."""
        serving = [slot.stats for slot in self._serving_slots()]
        everyone = [slot.stats for slot in self.slots.values()]
        return EngineStats(
            num_running=sum(s.num_running for s in serving),
            num_waiting=sum(s.num_waiting for s in serving),
            kv_cache_usage=sum(s.kv_cache_usage for s in serving) / max(1, len(serving)),
            num_preemptions=sum(s.num_preemptions for s in everyone),
            num_steps=sum(s.num_steps for s in everyone),
            num_waiting_for_kv=sum(s.num_waiting_for_kv for s in serving),
            num_holding_kv=sum(s.num_holding_kv for s in everyone),
        )

    def health(self) -> dict[str, str]:
        """Each engine's state, for /health."""
        return {
            name: "serving" if slot.is_healthy else ("starting" if slot.is_restarting else "dead")
            for name, slot in self.slots.items()
        }

    # ----- what slots report ---------------------------------------------------------
    def on_outputs(self, slot: Slot, message: EngineCoreOutputs) -> None:
        if self.slots.get(slot.name) is not slot:
            return  # a worker no longer listed
        if self.link is not None:
            # Routers' requests; this server's own are below. Its /metrics count both.
            self.metrics.generation_tokens += self.link.on_outputs(message)
        if message.step is not None:
            self.metrics.step(message.step)
        if self.coordinator is not None:
            self.coordinator.on_outputs(slot.name, message)
            if slot.role == "prefill":
                return  # its refusals and KV events are the coordinator's business
        for request_id, reason in message.rejected.items():
            entry = self._release(request_id)
            self.processor.abort(request_id)
            if entry is not None:
                entry.stream._notify(RequestRejectedError(reason))
        _, to_abort = self.processor.process(message.outputs)
        self._observe(message)
        if to_abort:
            with contextlib.suppress(EngineDeadError):
                slot.send(AbortRequests(sequences=to_abort))
        for request_id in {o.request_id for o in message.outputs}:
            entry = self._in_flight.get(request_id)
            if entry is None:
                continue
            if entry.stream.output.finished:
                self._release(request_id)
            entry.stream._notify()

    def _observe(self, message: EngineCoreOutputs) -> None:
        """Tokens and ends of sequences, for /metrics (after the output processor, which
        knows the sequences a stop string ended)."""
        now = time.monotonic()
        step_ended_at = message.step.ended_at if message.step is not None else 0.0
        for output in message.outputs:
            self.metrics.tokens(output, step_ended_at, now)
            entry = self._in_flight.get(output.request_id)
            if entry is not None:
                completion = entry.stream.output.outputs[output.index]
                if completion.finished:
                    self.metrics.sequence_finished(output.request_id, output.index, completion.finish_reason or "abort")

    def on_dead(self, slot: Slot, reason: str) -> None:
        """Fail what the engine held; a prefill engine's prompts go elsewhere."""
        if self.slots.get(slot.name) is not slot:
            return
        if self.link is not None:
            self.link.on_engine_dead(reason)
        if self.coordinator is None:
            lost = list(self._in_flight)
        else:
            lost = self.coordinator.remove_engine(slot.name)
        self._fail(lost, EngineDeadError(reason))

    def on_ready(self, slot: Slot) -> None:
        """An engine takes work (again): a restarted one, or a worker that answered.
        ValueError if the engine cannot work with the others (its KV layout, its limits)."""
        if self.slots.get(slot.name) is not slot or slot.info is None:
            return
        if self.coordinator is not None:
            self.coordinator.add_engine(slot.name, slot.info)
        if self.link is not None:
            self.link.on_engine_ready(slot.info)
        if slot.role == "decode" and self.workers is not None:
            if self.info is None:
                self.info = slot.info  # the limits requests are checked against
            self._decode_ready.set()

    def on_gave_up(self, slot: Slot, reason: str) -> None:
        """An engine will not start again: the server ends once none can serve."""
        others = [s for s in self._serving_slots() if s is not slot]
        if slot.role == "prefill" or any(s.dead_reason is None or s.is_restarting for s in others):
            logger.error("%s; serving on without it", reason)
        elif self.on_fatal is not None:
            self.on_fatal(reason)

    def on_draining(self, slot: Slot) -> None:
        """A worker is shutting down (or serving again): route new requests accordingly."""
        if self.coordinator is not None and self.slots.get(slot.name) is slot:
            self.coordinator.set_draining(slot.name, slot.draining)

    # ----- a router's workers ----------------------------------------------------------
    def update_workers(self, listed: dict[str, str]) -> None:
        """Drive the workers newly listed (URL -> role); stop driving those no longer listed."""
        for url in [url for url, slot in self.slots.items() if listed.get(url) != slot.role]:
            slot = self.slots[url]
            self.on_dead(slot, f"{url} is no longer listed as a {slot.role} worker")
            del self.slots[url]
            self._start_task(slot.shutdown(5.0), f"cadence-forget-{url}")
            logger.warning("stopped driving %s", url)
        for url, role in listed.items():
            if url not in self.slots:
                self.slots[url] = RemoteSlot(url, role, self._contexts[1], self, self._link_timing)
                self.slots[url].spawn()
                logger.info("driving %s as a %s worker", url, role)

    async def _follow_worker_list(self, interval: float = 2.0) -> None:
        """Re-read the worker file; a list that cannot be read keeps the last good one."""
        assert self.workers is not None
        complaint = ""
        while True:
            await asyncio.sleep(interval)
            try:
                listed = await asyncio.to_thread(self.workers.current)
            except (OSError, ValueError) as error:
                if str(error) != complaint:
                    logger.error("keeping the last worker list: %s", error)
                complaint = str(error)
                continue
            complaint = ""
            self.update_workers(listed)

    def _start_task(self, work: Coroutine[None, None, None], name: str) -> None:
        task = asyncio.create_task(work, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- requests ------------------------------------------------------------------
    @property
    def max_sequences(self) -> int:
        """The most sequences in flight at once: running plus waiting."""
        assert self.info is not None
        return self.info.max_num_seqs * len(self._serving_slots()) + self.max_waiting

    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, changed: asyncio.Event | None = None
    ) -> RequestStream:
        """Queue a request; raise EngineDeadError or EngineOverloadedError instead of queuing."""
        if self._refusal is not None:
            self.metrics.rejected("unavailable")
            raise self._refusal()
        if not self.is_healthy:
            self.metrics.rejected("unavailable")
            raise EngineDeadError(self.unavailable_reason)
        assert self.info is not None
        if request.request_id in self._in_flight:  # a client's X-Request-Id used twice at once
            raise RequestRejectedError(f"request id {request.request_id!r} is already in use")
        num_sequences = request.sampling_params.n
        if self._num_sequences + num_sequences > self.max_sequences:
            self.metrics.rejected("full")
            raise EngineOverloadedError(
                f"the server is full: {self._num_sequences} sequences are in flight "
                f"(max_num_seqs {self.info.max_num_seqs} x {len(self._serving_slots())} engines "
                f"+ max_waiting {self.max_waiting})"
            )
        self.processor.add_request(request.request_id, prompt, request.prompt_token_ids, request.sampling_params)
        try:
            # Sent before any other bookkeeping: a value msgpack cannot carry leaves no trace.
            engine = self._submit(request)
        except Exception:
            self.processor.abort(request.request_id)
            raise
        output = self.processor.states[request.request_id].output
        stream = RequestStream(self, output, self.processor, changed or asyncio.Event())
        self._in_flight[request.request_id] = _InFlight(stream, num_sequences, engine)
        self._num_sequences += num_sequences
        num_prompt = len(request.prompt_token_ids)
        max_tokens = request.sampling_params.max_tokens or self.info.max_model_len - num_prompt
        self.metrics.admitted(request.request_id, num_prompt, num_sequences, max_tokens)
        return stream

    def _submit(self, request: EngineCoreRequest) -> str:
        if self.coordinator is None:
            (slot,) = self.slots.values()
            slot.send(request)
            return slot.name
        try:
            return self.coordinator.add_request(request)
        except NoEngineError as error:
            raise EngineDeadError(str(error)) from error

    def abort(self, request_id: str) -> None:
        entry = self._release(request_id)
        if entry is None:
            return
        self.processor.abort(request_id)
        if self.coordinator is not None:
            self.coordinator.abort(request_id)
            return
        slot = self.slots[entry.engine]
        # An engine that is gone frees everything anyway; its exit is handled on its own.
        with contextlib.suppress(EngineDeadError):
            slot.send(AbortRequests(request_ids=[request_id]))

    def _send(self, engine: str, message: Message) -> None:
        """The coordinator's way to an engine; a dead one hears nothing (its death is
        handled when it is noticed)."""
        slot = self.slots.get(engine)
        if slot is not None:
            with contextlib.suppress(EngineDeadError):
                slot.send(message)

    def _release(self, request_id: str) -> _InFlight | None:
        entry = self._in_flight.pop(request_id, None)
        if entry is not None:
            self._num_sequences -= entry.num_sequences
            summary = self.metrics.request_finished(request_id, entry.num_sequences, "abort")  # its open sequences
            if summary is not None:
                log_finished(summary, entry.stream.output, self.log_prompts)
            if self.coordinator is not None and entry.stream.output.finished:
                self.coordinator.finished(request_id)
        return entry

    def end_all_requests(self, make_error: Callable[[], Exception]) -> None:
        """Abort every request in flight, failing each with an error of `make_error`, and
        refuse new ones so: the server's shutdown deadline has passed, and each client
        should hear why."""
        self._refusal = make_error
        if self._in_flight:
            count = len(self._in_flight)
            logger.warning("requests in flight at the shutdown deadline: %d; each ends: %s", count, make_error())
        for request_id, entry in list(self._in_flight.items()):
            self.abort(request_id)
            entry.stream._notify(make_error())

    def _fail(self, request_ids: list[str], error: Exception) -> None:
        for request_id in request_ids:
            entry = self._release(request_id)
            self.processor.abort(request_id)
            if entry is not None:
                entry.stream._notify(error)
