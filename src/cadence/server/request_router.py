"""Which engine takes a request, and where its abort goes.

Colocated (or a worker), the server's one engine takes everything. With prefill and
decode engines, the `Coordinator` (server/disaggregation/coordinator.py) picks a decode
engine and moves the request through its KV transfer; it hears every engine's outputs
for that.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from cadence.engine.protocol import AbortRequests, EngineCoreOutputs, EngineCoreRequest, EngineReady, Message
from cadence.server.disaggregation.coordinator import Coordinator, NoEngineError
from cadence.server.disaggregation.placement import PlacementPolicy
from cadence.server.engine_handle import EngineHandle
from cadence.server.engine_process import EngineDeadError


class RequestRouter:
    """Sends requests to the engines in `engines`; `send` reaches one by name, quietly
    dropping what a dead one would not hear."""

    def __init__(self, engines: Mapping[str, EngineHandle], send: Callable[[str, Message], None]) -> None:
        self.engines = engines
        self.send = send
        self.coordinator: Coordinator | None = None

    def route_by_role(self, placement: PlacementPolicy) -> None:
        """Route over prefill and decode engines from now on."""
        self.coordinator = Coordinator(self.send, placement)

    def submit(self, request: EngineCoreRequest) -> str:
        """Send the request to an engine and return that engine's name; EngineDeadError
        when none can take it."""
        if self.coordinator is None:
            (engine,) = self.engines.values()
            engine.send(request)
            return engine.name
        try:
            return self.coordinator.add_request(request)
        except NoEngineError as error:
            raise EngineDeadError(str(error)) from error

    def abort(self, request_id: str, engine: str) -> None:
        """Stop a request on every engine it touches (`engine` serves its outputs)."""
        if self.coordinator is not None:
            self.coordinator.abort(request_id)
            return
        # An engine that is gone frees everything anyway; its exit is handled on its own.
        self.send(engine, AbortRequests(request_ids=[request_id]))

    def finished(self, request_id: str) -> None:
        """Every sequence of the request has finished."""
        if self.coordinator is not None:
            self.coordinator.finished(request_id)

    # ----- engines --------------------------------------------------------------------
    def check_engine(self, name: str, info: EngineReady) -> None:
        """ValueError if the engine cannot work with the others (its KV layout, its limits)."""
        if self.coordinator is not None:
            self.coordinator.check_engine(name, info)

    def add_engine(self, name: str, info: EngineReady) -> None:
        """An engine takes requests (again); ValueError as `check_engine`."""
        if self.coordinator is not None:
            self.coordinator.add_engine(name, info)

    def remove_engine(self, name: str) -> list[str] | None:
        """Forget a dead engine; returns the requests lost with it, or None when every
        request in flight is (the server's one engine)."""
        if self.coordinator is None:
            return None
        return self.coordinator.remove_engine(name)

    def set_draining(self, name: str, draining: bool) -> None:
        if self.coordinator is not None:
            self.coordinator.set_draining(name, draining)

    def on_outputs(self, name: str, message: EngineCoreOutputs) -> None:
        """Every engine's step: its KV events move requests on."""
        if self.coordinator is not None:
            self.coordinator.on_outputs(name, message)
