"""When a wait for prompt KV, or a hold of it for a reader, ends even if nobody says so.

A lost message (a load never sent, a reader's release never delivered) must not park a
request or pin its blocks for ever. Pure Python, on time.monotonic.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVDeadlines:
    """Scheduler request id -> the time.monotonic at which its wait or hold ends."""

    wait_timeout: float
    hold_timeout: float
    ends: dict[str, float] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.ends)

    def start_wait(self, request_id: str, now: float) -> None:
        self.ends[request_id] = now + self.wait_timeout

    def start_hold(self, request_id: str, now: float) -> None:
        self.ends[request_id] = now + self.hold_timeout

    def extend_wait(self, request_id: str, now: float) -> None:
        """Wait `wait_timeout` from now for a request that has a deadline."""
        if request_id in self.ends:
            self.ends[request_id] = now + self.wait_timeout

    def drop(self, request_id: str) -> None:
        self.ends.pop(request_id, None)

    def take_due(self, now: float) -> list[str]:
        """Forget and return the ids whose time has come, in the order they were set."""
        due = [request_id for request_id, end in self.ends.items() if end <= now]
        for request_id in due:
            del self.ends[request_id]
        return due

    def earliest(self) -> float | None:
        return min(self.ends.values(), default=None)
