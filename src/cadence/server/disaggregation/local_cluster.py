"""Prefill and decode engines in one process, routed by the `Coordinator`: the
disaggregated flow without processes, for the tests."""

from __future__ import annotations

from cadence.engine.engine_core import EngineCore
from cadence.engine.protocol import (
    AbortRequests,
    CancelKVWait,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    ExtendKVWait,
    LoadKV,
    Message,
    ReleaseKV,
)
from cadence.server.disaggregation.coordinator import Coordinator
from cadence.server.disaggregation.placement import PlacementPolicy


class LocalCluster:
    """Steps every engine in turn and delivers the coordinator's messages at once.

    Outputs come from the decode engines only; the prefill engines' work shows up as
    KV events, which go to the coordinator.
    """

    def __init__(
        self, prefill: list[EngineCore], decode: list[EngineCore], placement: PlacementPolicy | None = None
    ) -> None:
        self.engines: dict[str, EngineCore] = {}
        self.engines.update({f"prefill-{i}": core for i, core in enumerate(prefill)})
        self.engines.update({f"decode-{i}": core for i, core in enumerate(decode)})
        self.coordinator = Coordinator(self._deliver, placement)
        for engine_id, core in self.engines.items():
            self.coordinator.add_engine(engine_id, core.ready_message())
        self._rejected: dict[str, dict[str, str]] = {}
        self.rejected: dict[str, str] = {}  # request id -> why a decode engine refused it
        self._remaining: dict[str, int] = {}  # request id -> sequences not yet finished

    def add_request(self, request: EngineCoreRequest) -> None:
        """Raises ValueError, changing nothing, for a request the engines cannot serve."""
        decode = self.engines[min(self.coordinator.decode)]
        decode.validate(request)
        self._remaining[request.request_id] = request.sampling_params.n
        self.coordinator.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.coordinator.abort(request_id)
            self._remaining.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._remaining)

    def step(self) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for engine_id, core in list(self.engines.items()):
            if engine_id not in self.engines:
                continue  # removed by a message delivered earlier in this pass
            produced = core.step() if core.has_work() else []
            if not produced:
                core.expire_kv_deadlines()
            events = core.take_kv_events()
            # Refused on arrival, or ended because a grammar failed: as the engine process reports them.
            rejected = {**self._rejected.pop(engine_id, {}), **core.take_failed_requests()}
            message = EngineCoreOutputs(
                produced, core.stats(), rejected, events.reserved, events.prefilled, events.loaded
            )
            self.coordinator.on_outputs(engine_id, message)
            if engine_id in self.coordinator.decode:
                for request_id, reason in rejected.items():
                    self.rejected[request_id] = reason
                    self._remaining.pop(request_id, None)
                outputs.extend(produced)
                self._count_finished(produced)
        return outputs

    def remove_engine(self, engine_id: str) -> list[str]:
        """Take an engine away as if its process died; returns the requests lost with it."""
        core = self.engines.pop(engine_id)
        core.close()
        lost = self.coordinator.remove_engine(engine_id)
        for request_id in lost:
            self._remaining.pop(request_id, None)
        return lost

    def _count_finished(self, produced: list[EngineCoreOutput]) -> None:
        for output in produced:
            if output.finished and output.request_id in self._remaining:
                self._remaining[output.request_id] -= 1
                if not self._remaining[output.request_id]:
                    del self._remaining[output.request_id]
                    self.coordinator.finished(output.request_id)

    def _deliver(self, engine_id: str, message: Message) -> None:
        core = self.engines.get(engine_id)
        if core is None:
            return  # a dead engine hears nothing
        if isinstance(message, EngineCoreRequest):
            try:
                core.add_request(message)
            except ValueError as error:
                self._rejected.setdefault(engine_id, {})[message.request_id] = str(error)
        elif isinstance(message, LoadKV):
            core.start_kv_load(message.request_id, message.source, message.block_ids)
        elif isinstance(message, ReleaseKV):
            core.release_sent_kv(message.request_ids)
        elif isinstance(message, CancelKVWait):
            core.cancel_kv_wait(message.request_ids, message.reason, message.chunk_tokens)
        elif isinstance(message, ExtendKVWait):
            core.extend_kv_wait(message.request_ids)
        elif isinstance(message, AbortRequests):
            core.abort_requests(message.request_ids)
        else:
            raise TypeError(f"an engine cannot take {type(message).__name__}")
