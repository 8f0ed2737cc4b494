"""The server's handle on its engines, as the HTTP handlers see it.

It puts together one part per job and carries the engines' events between them:
- the `EngineSupervisor` (server/engine_supervisor.py) starts the engines, or drives a
  router's workers elsewhere, starts them again when they die, and says whether any
  can serve;
- the `RequestRouter` (server/request_router.py) picks the engine for each request: the
  one engine, or, disaggregated, the `Coordinator`'s choice;
- `Admission` (server/admission.py) refuses what cannot be served now (503, 429);
- the `OutputFanOut` (server/output_fanout.py) feeds each request's `RequestStream`.

Engines put what happens to them on one queue (server/engine_events.py); one task here
takes each event in order and tells the parts that care. A dead prefill engine costs no
request (its prompts are computed elsewhere); a dead decode engine fails the requests it
held. As a worker, `open_link` lets routers on other hosts drive the server's engine.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from cadence.engine.engine_args import EngineArgs
from cadence.engine.output_processor import OutputProcessor
from cadence.engine.protocol import EngineCoreOutputs, EngineCoreRequest, EngineReady, EngineStats
from cadence.server.admission import Admission
from cadence.server.disaggregation.coordinator import Coordinator
from cadence.server.disaggregation.topology import LinkTiming, Topology, WorkerList
from cadence.server.disaggregation.worker_link import WorkerLink
from cadence.server.engine_events import (
    DrainingChanged,
    EngineDied,
    EngineEvent,
    EngineGaveUp,
    EngineServing,
    OutputsArrived,
    WorkerUnlisted,
)
from cadence.server.engine_handle import EngineHandle
from cadence.server.engine_process import EngineDeadError
from cadence.server.engine_supervisor import EngineSupervisor
from cadence.server.local_engine import RestartPolicy
from cadence.server.output_fanout import OutputFanOut
from cadence.server.request_metrics import RequestMetrics
from cadence.server.request_router import RequestRouter
from cadence.server.request_stream import RequestStream

logger = logging.getLogger(__name__)


class AsyncEngineClient:
    """Starts the engines, admits and routes requests, and streams their outputs."""

    def __init__(
        self,
        max_waiting: int,
        restart: RestartPolicy | None = None,
        on_fatal: Callable[[str], None] | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.metrics = RequestMetrics(max_model_len=0)  # wait_ready() sets the length
        self._events: asyncio.Queue[EngineEvent] = asyncio.Queue()
        self.supervisor = EngineSupervisor(
            self._events.put_nowait, restart or RestartPolicy(), on_fatal, topology or Topology()
        )
        self.router = RequestRouter(self.supervisor.engines, self.supervisor.send)
        processor = OutputProcessor(tokenizer=None)  # wait_ready() sets the tokenizer
        self.fanout = OutputFanOut(processor, self.metrics, self.router)
        self.admission = Admission(max_waiting, self.supervisor, self.fanout, self.metrics)
        self.link: WorkerLink | None = None  # a worker's: routers elsewhere drive its engine
        self._consumer: asyncio.Task[None] | None = None

    # ----- what the handlers and /metrics read -----------------------------------------
    @property
    def info(self) -> EngineReady | None:
        return self.supervisor.info

    @property
    def engines(self) -> dict[str, EngineHandle]:
        return self.supervisor.engines

    @property
    def coordinator(self) -> Coordinator | None:
        return self.router.coordinator

    @property
    def log_prompts(self) -> bool:
        """Prompt and output text in the per-request log lines."""
        return self.fanout.log_prompts

    @log_prompts.setter
    def log_prompts(self, value: bool) -> None:
        self.fanout.log_prompts = value

    @property
    def is_healthy(self) -> bool:
        return self.supervisor.is_healthy

    @property
    def retry_after(self) -> int:
        return self.supervisor.retry_after

    @property
    def unavailable_reason(self) -> str:
        return self.supervisor.unavailable_reason

    @property
    def stats(self) -> EngineStats:
        return self.supervisor.stats

    def health(self) -> dict[str, str]:
        return self.supervisor.health()

    @property
    def max_sequences(self) -> int:
        return self.admission.max_sequences

    # ----- lifecycle -----------------------------------------------------------------
    def spawn(self, args: EngineArgs) -> None:
        """Start every engine process; `wait_ready` then waits for them.

        Split in two so the server can load its tokenizer while the engines load the model.
        """
        self._start_consumer()
        self.supervisor.spawn(args)
        if self.supervisor.topology.disaggregated:
            self.router.route_by_role(self.supervisor.topology.placement)

    def connect(self, workers: WorkerList, timing: LinkTiming) -> None:
        """Be a router: drive the engines of workers on other hosts, and follow their list.
        `wait_ready` then waits for the first decode worker; the others join as they answer."""
        self._start_consumer()
        self.router.route_by_role(self.supervisor.topology.placement)
        self.supervisor.connect(workers, timing, self.router.check_engine)

    async def wait_ready(self, timeout: float, tokenizer: PreTrainedTokenizerBase | None) -> EngineReady:
        """Wait for the engines' first EngineReady (a router: its first decode worker's)."""
        self.fanout.processor.tokenizer = tokenizer
        info = await self.supervisor.wait_ready(timeout)
        if self.supervisor.workers is None:
            for engine in self.supervisor.engines.values():
                assert engine.info is not None
                self.router.add_engine(engine.name, engine.info)
        self.metrics.max_model_len = info.max_model_len
        return info

    def open_link(self, address: str, timing: LinkTiming) -> WorkerLink:
        """Be a worker: let routers on other hosts drive this server's one engine."""
        (engine,) = self.supervisor.engines.values()
        assert self.info is not None, "wait_ready() first"
        self.link = WorkerLink(self.supervisor.contexts[1], address, engine.send, timing)
        self.link.on_engine_ready(self.info)
        self.link.start()
        return self.link

    async def drain_link(self, timeout: float) -> None:
        """A worker that is stopping: routers send nothing new; wait for what they sent."""
        if self.link is not None:
            await self.link.drain(timeout)

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Tell the engines to stop, wait for them, and kill any that will not."""
        if self.link is not None:
            await self.link.close()
        await self.supervisor.shutdown(timeout)
        if self._consumer is not None:
            self._consumer.cancel()
        self.fanout.fail(self.fanout.request_ids(), EngineDeadError("the server is shutting down"))

    # ----- requests ------------------------------------------------------------------
    def add_request(
        self, request: EngineCoreRequest, prompt: str | None, changed: asyncio.Event | None = None
    ) -> RequestStream:
        """Queue a request; raise EngineDeadError or EngineOverloadedError instead of queuing."""
        self.admission.check(request)
        assert self.info is not None
        return self.fanout.open(request, prompt, changed, self.info.max_model_len)

    def end_all_requests(self, make_error: Callable[[], Exception]) -> None:
        """Abort every request in flight, failing each with an error of `make_error`, and
        refuse new ones so: the server's shutdown deadline has passed, and each client
        should hear why."""
        self.admission.refuse_all(make_error)
        self.fanout.end_all(make_error)

    # ----- what engines report ---------------------------------------------------------
    def _start_consumer(self) -> None:
        if self._consumer is None:
            self._consumer = asyncio.create_task(self._consume_events(), name="cadence-engine-events")

    async def _consume_events(self) -> None:
        while True:
            event = await self._events.get()
            try:
                self._handle(event)
            except Exception as error:  # without its engine's events nothing it holds is served
                name = event.engine.name
                logger.exception("processing %s's events failed", name)
                event.engine.fail(f"processing {name}'s events failed: {error!r}")

    def _handle(self, event: EngineEvent) -> None:
        engine = event.engine
        if isinstance(event, WorkerUnlisted):
            self._lose(engine, event.reason)  # already forgotten by the supervisor
            return
        if self.supervisor.engines.get(engine.name) is not engine:
            return  # a worker no longer listed
        if isinstance(event, OutputsArrived):
            self._on_outputs(engine, event.message)
        elif isinstance(event, EngineDied):
            self._lose(engine, event.reason)
        elif isinstance(event, EngineServing):
            self._on_serving(engine)
        elif isinstance(event, EngineGaveUp):
            self.supervisor.gave_up(engine, event.reason)
        elif isinstance(event, DrainingChanged):
            self.router.set_draining(engine.name, event.draining)

    def _on_outputs(self, engine: EngineHandle, message: EngineCoreOutputs) -> None:
        if self.link is not None:
            # Routers' requests; this server's own are below. Its /metrics count both.
            self.metrics.generation_tokens += self.link.on_outputs(message)
        if message.step is not None:
            self.metrics.step(message.step)
        self.router.on_outputs(engine.name, message)
        if self.router.coordinator is not None and engine.role == "prefill":
            return  # its refusals and KV events are the coordinator's business
        self.fanout.deliver(engine.name, message)

    def _lose(self, engine: EngineHandle, reason: str) -> None:
        """Fail what the engine held; a prefill engine's prompts go elsewhere."""
        if self.link is not None:
            self.link.on_engine_dead(reason)
        lost = self.router.remove_engine(engine.name)
        self.fanout.fail(self.fanout.request_ids() if lost is None else lost, EngineDeadError(reason))

    def _on_serving(self, engine: EngineHandle) -> None:
        """An engine takes work (again): a restarted one, or a worker that answered."""
        if engine.info is None:
            return
        self.router.add_engine(engine.name, engine.info)
        if self.link is not None:
            self.link.on_engine_ready(engine.info)
        self.supervisor.note_serving(engine)
