"""What the engine client needs of one engine, wherever it runs: a local process
(server/local_engine.py) or a worker's engine on another host
(server/disaggregation/remote_engine.py). An engine knows nothing of requests: it reports
what happens to it as events (server/engine_events.py) and takes messages to send."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cadence.engine.protocol import EngineReady, EngineStats, Message


@dataclass
class EngineCounters:
    """Totals that outlive an engine's processes (or a worker's sessions)."""

    restarts: int = 0
    steps_before: int = 0
    preemptions_before: int = 0


class EngineHandle(Protocol):
    """One engine the client drives, named and of one role."""

    name: str
    role: str  # "colocated", "prefill" or "decode"
    info: EngineReady | None
    stats: EngineStats
    counters: EngineCounters
    dead_reason: str | None
    draining: bool  # finishing what it has before it stops: give it nothing new

    @property
    def is_healthy(self) -> bool: ...

    @property
    def is_restarting(self) -> bool: ...

    @property
    def retry_after(self) -> int: ...

    @property
    def unavailable_reason(self) -> str: ...

    def spawn(self) -> None: ...

    async def wait_ready(self, timeout: float) -> EngineReady: ...

    async def shutdown(self, timeout: float) -> None: ...

    def send(self, message: Message) -> None: ...

    def fail(self, reason: str) -> None:
        """The client could not handle what this engine reported: treat the engine as
        dead (its requests fail) and start it, or a new session with it, again."""
        ...
