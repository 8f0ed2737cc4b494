"""The hooks through which the scheduler meets the scheduler half of a KV connector.

A request whose prompt KV crosses engines waits outside the scheduler's queues: on a
decode engine until its KV arrives, on a prefill engine until a reader is done with it.
The scheduler knows nothing of either wait. It calls a connector at four points (admit,
update after a step, finish, has-work), passes on each step's transfer work to the
runner, and takes back the requests the connector lets go (`enqueue`, `end_request`).
Admit and update concern only requests whose KV crosses engines (`Request.remote_kv`
set): the scheduler spares the others the calls, on the path every step takes.
An engine without a disaggregation role has no connector, and the scheduler skips the
hooks.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import TYPE_CHECKING

from cadence.scheduler.remote_kv import KVLoad
from cadence.scheduler.request import Request

if TYPE_CHECKING:
    from cadence.scheduler.scheduler import Scheduler


class Admission(enum.Enum):
    """What the connector made of a waiting request the scheduler is about to admit."""

    SCHEDULE = "schedule"  # not the connector's: admit it like any other
    PARKED = "parked"  # the connector reserved its blocks and keeps it until its KV arrives
    NO_BLOCKS = "no_blocks"  # the connector needs blocks the cache does not have now


class SchedulerConnector(ABC):
    """The scheduler half of a KV connector: the requests it keeps out of the queues,
    the transfer work it hands the runner each step, and the blocks it keeps alive."""

    @abstractmethod
    def attach(self, scheduler: Scheduler) -> None:
        """Called once by the scheduler that owns this connector."""

    @abstractmethod
    def uses_request_id(self, request_id: str) -> bool:
        """Whether the connector still holds blocks under this id (a new request may not take it)."""

    @abstractmethod
    def admit(self, request: Request) -> Admission:
        """Before a waiting request is admitted: park it, or leave it to the scheduler."""

    @abstractmethod
    def update(self, request: Request) -> bool:
        """After a request's tokens were computed (or found cached): True if the connector
        takes it, in which case the scheduler drops it from its queues and the runner."""

    @abstractmethod
    def finish(self, request: Request) -> None:
        """A request ends; the connector forgets it, and may keep its blocks from being
        freed (it then empties `request.block_ids`)."""

    @abstractmethod
    def has_work(self) -> bool:
        """Whether a step would start, stop or wait on a transfer."""

    @abstractmethod
    def take_step_work(self) -> tuple[list[KVLoad], list[str]]:
        """The loads to start and the request ids whose loads to stop, for this step's runner."""

    @abstractmethod
    def parked_requests(self) -> list[Request]:
        """The live requests the connector keeps out of the scheduler's queues."""

    @abstractmethod
    def blocks_without_request(self) -> Iterable[list[int]]:
        """Blocks the connector keeps alive for requests that already ended."""

    @abstractmethod
    def check_integrity(self) -> None:
        """Assert the connector's state agrees with its scheduler's (tests call it every step)."""
