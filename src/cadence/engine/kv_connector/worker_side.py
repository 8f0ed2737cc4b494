"""The worker half of the KV connector: moves blocks between engines over a transport.

The model runner hands it the KV caches once, then each step's `SchedulerOutput`; it
starts the step's loads, stops the cancelled ones and reports the loads that ended. What
a load is made of (sockets, shared memory, NIXL agents) is the transport's business
(engine/kv_transfer/).
"""

from __future__ import annotations

import torch

from cadence.engine.attention.backend import KVCache
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.kv_transfer.transport import KVTransport
from cadence.scheduler.output import SchedulerOutput
from cadence.scheduler.remote_kv import KVLoadResult


class WorkerSideConnector:
    """Runs the transfers that the scheduler half asks for, on this engine's caches."""

    def __init__(self, transport: KVTransport) -> None:
        self.transport = transport
        self.kv_caches: list[KVCache] = []

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Storage for one KV cache tensor, in memory the transport can move."""
        return self.transport.zeros(shape, dtype=dtype, device=device)

    def register_kv_caches(self, kv_caches: list[KVCache]) -> None:
        """The caches that loads write into, and that `export` makes readable."""
        self.kv_caches = kv_caches

    def export(self, layout: KVLayout) -> KVSource:
        """Make this engine's caches readable by other engines (a prefill engine's, once)."""
        return self.transport.export(self.kv_caches, layout)

    def transfer(self, output: SchedulerOutput) -> list[KVLoadResult]:
        """Start and stop the step's loads (into blocks no scheduled request touches), and
        report those that ended."""
        transport = self.transport
        for load in output.kv_loads:
            transport.start_load(load, self.kv_caches)
        for request_id in output.kv_cancels:
            transport.cancel(request_id)
        return transport.poll()

    def close(self) -> None:
        """Stop exporting and release what the transport holds (memory, sockets, agents)."""
        self.transport.close()
