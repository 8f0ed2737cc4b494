"""Whether a new request may enter now.

A request is refused with 503 (and Retry-After, until the next engine start) while no
engine can serve it or once the shutdown deadline has passed, and with 429 when the
sequences in flight would pass what the engines run plus `max_waiting`. The HTTP
handlers turn these errors into responses (server/serving.py `as_api_error`).
"""

from __future__ import annotations

from collections.abc import Callable

from cadence.engine.protocol import EngineCoreRequest
from cadence.server.engine_process import EngineDeadError
from cadence.server.engine_supervisor import EngineSupervisor
from cadence.server.output_fanout import OutputFanOut, RequestRejectedError
from cadence.server.request_metrics import RequestMetrics


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class Admission:
    """Checks each request against the engines' health and the sequences in flight."""

    def __init__(
        self, max_waiting: int, engines: EngineSupervisor, in_flight: OutputFanOut, metrics: RequestMetrics
    ) -> None:
        self.max_waiting = max_waiting
        self.engines = engines
        self.in_flight = in_flight
        self.metrics = metrics
        # Past the shutdown deadline: makes the error every request gets instead of an answer.
        self._refusal: Callable[[], Exception] | None = None

    @property
    def max_sequences(self) -> int:
        """The most sequences in flight at once: running plus waiting."""
        assert self.engines.info is not None
        return self.engines.info.max_num_seqs * len(self.engines.serving_engines()) + self.max_waiting

    def refuse_all(self, make_error: Callable[[], Exception]) -> None:
        """From now on every request fails with an error of `make_error`."""
        self._refusal = make_error

    def check(self, request: EngineCoreRequest) -> None:
        """Raise EngineDeadError or EngineOverloadedError (or the refusal's error)
        instead of letting the request in."""
        if self._refusal is not None:
            self.metrics.rejected("unavailable")
            raise self._refusal()
        if not self.engines.is_healthy:
            self.metrics.rejected("unavailable")
            raise EngineDeadError(self.engines.unavailable_reason)
        info = self.engines.info
        assert info is not None
        if request.request_id in self.in_flight:  # a client's X-Request-Id used twice at once
            raise RequestRejectedError(f"request id {request.request_id!r} is already in use")
        num_sequences = request.sampling_params.n
        if self.in_flight.num_sequences + num_sequences > self.max_sequences:
            self.metrics.rejected("full")
            raise EngineOverloadedError(
                f"the server is full: {self.in_flight.num_sequences} sequences are in flight "
                f"(max_num_seqs {info.max_num_seqs} x {len(self.engines.serving_engines())} engines "
                f"+ max_waiting {self.max_waiting})"
            )
