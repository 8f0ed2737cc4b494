"""KV transfer between engines in one process, for tests and the offline API.

An exported cache is found by its address in a process-wide table; a load is a tensor
copy that ends before `start_load` returns.
"""

from __future__ import annotations

import uuid
import weakref

from cadence.engine.attention.backend import KVCache
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.kv_transfer.transport import SynchronousTransport, copy_blocks
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult


class InProcessTransport(SynchronousTransport):
    """Blocks copied straight out of another engine's tensors in this process."""

    name = "in-process"
    # Exporting transports by address; an engine that is gone is simply not found.
    _exported: weakref.WeakValueDictionary[str, InProcessTransport] = weakref.WeakValueDictionary()

    def __init__(self) -> None:
        self.kv_caches: list[KVCache] = []
        self.address = f"in-process:{uuid.uuid4().hex}"
        super().__init__()

    def export(self, kv_caches: list[KVCache], layout: KVLayout) -> KVSource:
        self.kv_caches = kv_caches
        InProcessTransport._exported[self.address] = self
        return KVSource(self.name, self.address, layout)

    def start_load(self, load: KVLoad, kv_caches: list[KVCache]) -> None:
        source = load.source
        exporter = InProcessTransport._exported.get(source.address) if isinstance(source, KVSource) else None
        if exporter is None:
            self._results.append(KVLoadResult(load.request_id, 0, f"no engine exports {source!r} in this process"))
            return
        copy_blocks(exporter.kv_caches, kv_caches, load.remote_block_ids, load.local_block_ids)
        self._results.append(KVLoadResult(load.request_id, len(load.local_block_ids)))

    def close(self) -> None:
        InProcessTransport._exported.pop(self.address, None)
