"""Every request in flight and its stream: engines' outputs in, each request's handler
woken.

A step's outputs go through the `OutputProcessor` (detokenization, stop strings, logprob
dicts), and the `RequestStream` of every request that changed is woken. Handlers only
ever await their own stream, so a slow client never delays anyone else. A request
leaves when it finishes, is aborted, is refused by its engine, or is lost with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cadence.engine.output_processor import OutputProcessor
from cadence.engine.protocol import AbortRequests, EngineCoreOutputs, EngineCoreRequest
from cadence.server.request_log import log_finished
from cadence.server.request_metrics import RequestMetrics
from cadence.server.request_router import RequestRouter
from cadence.server.request_stream import RequestStream

logger = logging.getLogger(__name__)


class RequestRejectedError(ValueError):
    """The engine refused one request (the front end's checks let it through)."""


@dataclass
class _InFlight:
    stream: RequestStream
    num_sequences: int
    engine: str  # the engine that serves its outputs


class OutputFanOut:
    """Opens a stream per request, routed by `router`, and feeds it the engines' outputs."""

    def __init__(self, processor: OutputProcessor, metrics: RequestMetrics, router: RequestRouter) -> None:
        self.processor = processor
        self.metrics = metrics
        self.router = router
        self.log_prompts = False  # prompt and output text in the per-request log lines
        self.num_sequences = 0  # of the requests in flight
        self._in_flight: dict[str, _InFlight] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._in_flight

    def request_ids(self) -> list[str]:
        return list(self._in_flight)

    def open(
        self, request: EngineCoreRequest, prompt: str | None, changed: asyncio.Event | None, max_model_len: int
    ) -> RequestStream:
        """Send the request to its engine and return its stream."""
        num_sequences = request.sampling_params.n
        self.processor.add_request(request.request_id, prompt, request.prompt_token_ids, request.sampling_params)
        try:
            # Sent before any other bookkeeping: a value msgpack cannot carry leaves no trace.
            engine = self.router.submit(request)
        except Exception:
            self.processor.abort(request.request_id)
            raise
        output = self.processor.states[request.request_id].output
        stream = RequestStream(output, self.processor, changed or asyncio.Event(), self.abort)
        self._in_flight[request.request_id] = _InFlight(stream, num_sequences, engine)
        self.num_sequences += num_sequences
        num_prompt = len(request.prompt_token_ids)
        max_tokens = request.sampling_params.max_tokens or max_model_len - num_prompt
        self.metrics.admitted(request.request_id, num_prompt, num_sequences, max_tokens)
        return stream

    def deliver(self, engine: str, message: EngineCoreOutputs) -> None:
        """One step of the engine that serves requests' outputs."""
        for request_id, reason in message.rejected.items():
            entry = self._release(request_id)
            self.processor.abort(request_id)
            if entry is not None:
                entry.stream.notify(RequestRejectedError(reason))
        _, to_abort = self.processor.process(message.outputs)
        self._observe(message)
        if to_abort:
            self.router.send(engine, AbortRequests(sequences=to_abort))
        for request_id in {o.request_id for o in message.outputs}:
            entry = self._in_flight.get(request_id)
            if entry is None:
                continue
            if entry.stream.output.finished:
                self._release(request_id)
            entry.stream.notify()

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

    def abort(self, request_id: str) -> None:
        """The client is gone: stop the request wherever it runs."""
        entry = self._release(request_id)
        if entry is None:
            return
        self.processor.abort(request_id)
        self.router.abort(request_id, entry.engine)

    def fail(self, request_ids: list[str], error: Exception) -> None:
        """End requests the engines no longer hold, each stream raising `error`."""
        for request_id in request_ids:
            entry = self._release(request_id)
            self.processor.abort(request_id)
            if entry is not None:
                entry.stream.notify(error)

    def end_all(self, make_error: Callable[[], Exception]) -> None:
        """Abort every request in flight, failing each with an error of `make_error`."""
        if self._in_flight:
            count = len(self._in_flight)
            logger.warning("requests in flight at the shutdown deadline: %d; each ends: %s", count, make_error())
        for request_id, entry in list(self._in_flight.items()):
            self.abort(request_id)
            entry.stream.notify(make_error())

    def _release(self, request_id: str) -> _InFlight | None:
        entry = self._in_flight.pop(request_id, None)
        if entry is not None:
            self.num_sequences -= entry.num_sequences
            summary = self.metrics.request_finished(request_id, entry.num_sequences, "abort")  # its open sequences
            if summary is not None:
                log_finished(summary, entry.stream.output, self.log_prompts)
            if entry.stream.output.finished:
                self.router.finished(request_id)
        return entry
