"""What engines report to the engine client, as values on one queue.

Each engine's own task (its output reader, its restarts, its link session) puts events;
the client's one consumer takes them in order and acts. Nothing an engine does calls
back into the client, so the two never re-enter each other, and an engine's events are
handled in the order they happened.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cadence.engine.protocol import EngineCoreOutputs
from cadence.server.engine_handle import EngineHandle


@dataclass(frozen=True)
class OutputsArrived:
    """One step's outputs, KV events and gauges."""

    engine: EngineHandle
    message: EngineCoreOutputs


@dataclass(frozen=True)
class EngineDied:
    """What the engine held is gone; it may be started (or reached) again."""

    engine: EngineHandle
    reason: str


@dataclass(frozen=True)
class EngineServing:
    """The engine takes work (again): a restarted one, or a worker that answered."""

    engine: EngineHandle


@dataclass(frozen=True)
class EngineGaveUp:
    """The engine will not be started again."""

    engine: EngineHandle
    reason: str


@dataclass(frozen=True)
class DrainingChanged:
    """A worker is shutting down (or serving again): it gets no new requests meanwhile."""

    engine: EngineHandle
    draining: bool


@dataclass(frozen=True)
class WorkerUnlisted:
    """A router stopped driving a worker (no longer in its list): what it held is lost."""

    engine: EngineHandle
    reason: str


EngineEvent = OutputsArrived | EngineDied | EngineServing | EngineGaveUp | DrainingChanged | WorkerUnlisted
# Where an engine puts its events: the client's queue (`put_nowait`), never blocking.
EventSink = Callable[[EngineEvent], None]
