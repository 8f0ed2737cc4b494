"""When a failed call is tried again, and after how long.

Retried: 429 (the server is full) and 503 (its engine is down or restarting), and
connection failures. A timeout is retried when the request never reached the server (a
connect or pool timeout); a read or write timeout is not, unless `retry_timeouts` says so:
the server may be generating that answer still, and sending it again doubles the work the
time limit was meant to bound (the openai SDK retries them; set `retry_timeouts=True` for
its behaviour). Other errors are the caller's to fix and never retried.

The wait honours the answer's Retry-After (seconds or an HTTP date), capped at
`max_retry_after`; without one it is an exponential backoff with jitter, so that many
clients refused together do not come back together.

A stream is retried only while it has not started: once its body has begun, a failure is
raised, never replayed (the caller may already hold chunks of it).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Literal

from cadence.client.errors import (
    APIConnectionError,
    APIStatusError,
    APITimeoutError,
    CadenceError,
    RateLimitError,
    ServiceUnavailableError,
)

Jitter = Literal["full", "decorrelated", "none"]


@dataclass
class RetryPolicy:
    """How a client retries. `jitter`: "full" waits a uniform time up to the exponential
    backoff; "decorrelated" a uniform time between `initial_backoff` and three times the
    last wait (AWS's two schemes); "none" the backoff itself. `rng` may be seeded."""

    max_retries: int = 2
    initial_backoff: float = 0.5
    max_backoff: float = 8.0
    jitter: Jitter = "full"
    max_retry_after: float = 60.0
    retry_timeouts: bool = False
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_retries < 0:
            raise ValueError("max_retries must be 0 or more")
        if not 0 <= self.initial_backoff <= self.max_backoff:
            raise ValueError("backoffs must satisfy 0 <= initial_backoff <= max_backoff")

    def is_retryable(self, error: CadenceError) -> bool:
        """Whether a call that failed so may be tried again."""
        if isinstance(error, APITimeoutError):
            return self.retry_timeouts or error.phase in ("connect", "pool")
        return isinstance(error, (APIConnectionError, RateLimitError, ServiceUnavailableError))

    def backoff(self, retry: int, previous: float) -> float:
        """The wait before retry number `retry` (0 for the first) without a Retry-After;
        `previous` is the last wait, which decorrelated jitter grows from."""
        if self.jitter == "decorrelated":
            upper = max(previous, self.initial_backoff) * 3
            return min(self.max_backoff, self.rng.uniform(self.initial_backoff, upper))
        ceiling = min(self.max_backoff, self.initial_backoff * 2**retry)
        return self.rng.uniform(0.0, ceiling) if self.jitter == "full" else ceiling

    def attempts(self) -> Attempts:
        """A fresh count of retries, for one call."""
        return Attempts(self)


def parse_retry_after(value: str, now: float | None = None) -> float | None:
    """Seconds to wait from a Retry-After value (seconds, or an HTTP date); None when it
    is neither."""
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP date is GMT; a naive one would read as local time
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


class Attempts:
    """The retries one call has made, and the wait before its next."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.retries = 0
        self.previous_delay = 0.0

    def next_delay(self, error: CadenceError) -> float | None:
        """Seconds to wait before trying again after `error`, or None: raise it."""
        policy = self.policy
        if self.retries >= policy.max_retries or not policy.is_retryable(error):
            return None
        delay = None
        if isinstance(error, APIStatusError) and "retry-after" in error.headers:
            delay = parse_retry_after(error.headers["retry-after"])
        if delay is None:
            delay = policy.backoff(self.retries, self.previous_delay)
        delay = min(delay, policy.max_retry_after)
        self.retries += 1
        self.previous_delay = delay
        return delay
