"""The engines a server drives, kept alive: started, started again when they die, and
asked whether any can serve.

Beside the server they are local processes (`LocalEngine`, restarted with backoff by the
`RestartPolicy`); a router drives workers' engines elsewhere (`RemoteEngine`), following
the worker list. Only engines that take requests count for health: every decode engine
when requests are routed by role, else the one engine. Starts that keep failing end the
server (`on_fatal`) once no engine can serve.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Coroutine

import zmq
import zmq.asyncio

from cadence.engine.engine_args import EngineArgs
from cadence.engine.protocol import EngineReady, EngineStats, Message
from cadence.server.disaggregation.remote_engine import ReadyCheck, RemoteEngine
from cadence.server.disaggregation.topology import LinkTiming, Topology, WorkerList, split_cpus
from cadence.server.engine_events import EventSink, WorkerUnlisted
from cadence.server.engine_handle import EngineHandle
from cadence.server.engine_process import EngineDeadError
from cadence.server.ipc_addresses import address_prefix
from cadence.server.leftover_sockets import remove_dead_socket_folders
from cadence.server.local_engine import LocalEngine, RestartPolicy

logger = logging.getLogger(__name__)


class EngineSupervisor:
    """Owns the engines by name; each puts its events on `events`."""

    def __init__(
        self,
        events: EventSink,
        restart: RestartPolicy,
        on_fatal: Callable[[str], None] | None,
        topology: Topology,
    ) -> None:
        self.events = events
        self.restart_policy = restart
        self.on_fatal = on_fatal
        self.topology = topology
        self.engines: dict[str, EngineHandle] = {}
        self.info: EngineReady | None = None  # the limits requests are checked against
        self.workers: WorkerList | None = None  # a router's: it drives engines elsewhere
        self.contexts = (zmq.Context(), zmq.asyncio.Context())
        self._address_prefix = address_prefix()
        self._link_timing = LinkTiming()
        self._check_ready: ReadyCheck | None = None
        self._decode_ready = asyncio.Event()
        # Work shutdown waits for: workers no longer listed, being let go; the sweep of
        # dead servers' socket folders.
        self._tasks: set[asyncio.Task[None]] = set()
        self._follow_task: asyncio.Task[None] | None = None

    @property
    def routes_by_role(self) -> bool:
        """Whether requests go to decode engines, their prompts perhaps to prefill ones."""
        return self.topology.disaggregated or self.workers is not None

    # ----- starting and stopping ------------------------------------------------------
    def spawn(self, args: EngineArgs) -> None:
        """Start every engine process; `wait_ready` then waits for them."""
        engines = self.topology.engines(args)
        cpus = split_cpus(list(engines))
        for name, engine_args in engines.items():
            engine = LocalEngine(
                name, engine_args, self._address_prefix, self.contexts, self.restart_policy, self.events, cpus[name]
            )
            self.engines[name] = engine
            engine.spawn()
        # While the engines load: the sweep pauses a moment when it finds a suspect.
        self._start_task(self._remove_leftovers(), "cadence-remove-leftovers")

    @staticmethod
    async def _remove_leftovers() -> None:
        """Remove the socket folders of dead servers of older versions (this one leaves none)."""
        await asyncio.to_thread(remove_dead_socket_folders)

    def connect(self, workers: WorkerList, timing: LinkTiming, check_ready: ReadyCheck) -> None:
        """Drive the engines of workers on other hosts, and follow their list. A worker's
        engine is taken only once `check_ready` accepts it."""
        self.workers, self._link_timing, self._check_ready = workers, timing, check_ready
        self.update_workers(workers.current())
        self._follow_task = asyncio.create_task(self._follow_worker_list(), name="cadence-worker-list")

    async def wait_ready(self, timeout: float) -> EngineReady:
        """Wait for every local engine's first EngineReady, or a router's first decode worker
        (the others join as they answer). Returns the limits requests are checked against."""
        assert self.engines or self.workers is not None, "spawn() or connect() first"
        if self.workers is not None:
            try:
                await asyncio.wait_for(self._decode_ready.wait(), timeout)
            except TimeoutError:
                reasons = "; ".join(engine.unavailable_reason for engine in self.engines.values())
                raise EngineDeadError(f"no decode worker was ready within {timeout:g} s: {reasons}") from None
            assert self.info is not None
            return self.info
        readies = await asyncio.gather(*(engine.wait_ready(timeout) for engine in self.engines.values()))
        for engine, info in zip(self.engines.values(), readies):
            logger.info(
                "%s ready on %s (%s): %d KV blocks, max_model_len %d, max_num_seqs %d",
                engine.name,
                info.device,
                info.dtype,
                info.num_kv_blocks,
                info.max_model_len,
                info.max_num_seqs,
            )
        self.info = readies[-1]  # a decode engine's when disaggregated: it serves the requests
        return self.info

    async def shutdown(self, timeout: float) -> None:
        """Stop every engine (a worker's session ends), killing any that will not stop."""
        if self._follow_task is not None:
            self._follow_task.cancel()
        # Workers no longer listed are still being let go: their sockets must close first.
        await asyncio.gather(*self._tasks, *(engine.shutdown(timeout) for engine in self.engines.values()))
        for context in self.contexts:
            context.destroy(linger=0)

    # ----- what engines report --------------------------------------------------------
    def note_serving(self, engine: EngineHandle) -> None:
        """A router's decode worker answered: the server can take requests."""
        if engine.role == "decode" and self.workers is not None:
            if self.info is None:
                self.info = engine.info
            self._decode_ready.set()

    def gave_up(self, engine: EngineHandle, reason: str) -> None:
        """An engine will not start again: the server ends once none can serve."""
        others = [e for e in self.serving_engines() if e is not engine]
        if engine.role == "prefill" or any(e.dead_reason is None or e.is_restarting for e in others):
            logger.error("%s; serving on without it", reason)
        elif self.on_fatal is not None:
            self.on_fatal(reason)

    def send(self, engine: str, message: Message) -> None:
        """To an engine by name; a dead or forgotten one hears nothing (its death is
        handled when it is noticed)."""
        handle = self.engines.get(engine)
        if handle is not None:
            with contextlib.suppress(EngineDeadError):
                handle.send(message)

    # ----- health ---------------------------------------------------------------------
    def serving_engines(self) -> list[EngineHandle]:
        """The engines that take requests: every decode engine a router (or this server)
        routes to, or the one engine (a worker's, whatever its role)."""
        if not self.routes_by_role:
            return list(self.engines.values())
        return [engine for engine in self.engines.values() if engine.role != "prefill"]

    @property
    def is_healthy(self) -> bool:
        """Whether a request can be served now (a dead prefill engine does not stop that)."""
        return any(engine.is_healthy for engine in self.serving_engines())

    @property
    def retry_after(self) -> int:
        """Seconds a refused client should wait: until the next engine start, at least one."""
        waits = [engine.retry_after for engine in self.serving_engines() if engine.is_restarting]
        return min(waits, default=1)

    @property
    def unavailable_reason(self) -> str:
        """Why requests are refused now (only meaningful while not healthy)."""
        return "; ".join(engine.unavailable_reason for engine in self.serving_engines())

    @property
    def stats(self) -> EngineStats:
        """The gauges of the engines that serve requests, summed (usage averaged)."""
        serving = [engine.stats for engine in self.serving_engines()]
        everyone = [engine.stats for engine in self.engines.values()]
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
            name: "serving" if engine.is_healthy else ("starting" if engine.is_restarting else "dead")
            for name, engine in self.engines.items()
        }

    # ----- a router's workers ---------------------------------------------------------
    def update_workers(self, listed: dict[str, str]) -> None:
        """Drive the workers newly listed (URL -> role); stop driving those no longer listed."""
        for url in [url for url, engine in self.engines.items() if listed.get(url) != engine.role]:
            engine = self.engines.pop(url)
            self.events(WorkerUnlisted(engine, f"{url} is no longer listed as a {engine.role} worker"))
            self._start_task(engine.shutdown(5.0), f"cadence-forget-{url}")
            logger.warning("stopped driving %s", url)
        for url, role in listed.items():
            if url not in self.engines:
                check = self._check_ready
                assert check is not None, "connect() first"
                remote = RemoteEngine(url, role, self.contexts[1], self.events, self._link_timing, check)
                self.engines[url] = remote
                remote.spawn()
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
