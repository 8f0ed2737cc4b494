"""One request's view of the engine: its output so far, woken at each step that changed it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from cadence.engine.output_processor import OutputProcessor
from cadence.engine.outputs import RequestOutput


class RequestStream:
    """`output` is updated in place by the output fan-out, which then sets `changed` (an
    event several streams may share). A handler reads `output` right after the event
    fires, before awaiting anything else, so it always sees one consistent step.
    """

    def __init__(
        self,
        output: RequestOutput,
        processor: OutputProcessor,
        changed: asyncio.Event,
        on_abort: Callable[[str], None],
    ) -> None:
        self._processor = processor
        self._on_abort = on_abort
        self.output = output
        self.changed = changed
        self._error: Exception | None = None

    @property
    def request_id(self) -> str:
        return self.output.request_id

    def notify(self, error: Exception | None = None) -> None:
        """Wake the handler: the output changed, or the request failed with `error`."""
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
            self._on_abort(self.request_id)
