"""KV transports, which the KV connector's worker half (engine/kv_connector/) moves
blocks with: making one engine's blocks readable, and reading them.

The decode side reads: every write into its blocks is its own, so an abort, a deadline
or a dead prefill engine is handled by cancelling its own reads, and a block is never
reused while a transfer could still write into it (the connector's scheduler half holds
the blocks of a cancelled load until the transport reports it over). The prefill side
only holds its blocks still until it is told the reader is done.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np
import torch

from cadence.engine.attention.backend import KVCache, split_kv_cache
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult


class KVTransport(ABC):
    """Exports this engine's KV cache to readers, and loads blocks from other engines."""

    name: str

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Storage for one KV cache tensor; transports that need special memory override it."""
        return torch.zeros(shape, dtype=dtype, device=device)

    @abstractmethod
    def export(self, kv_caches: list[KVCache], layout: KVLayout) -> KVSource:
        """Make this engine's caches readable by other engines; called once."""

    @abstractmethod
    def start_load(self, load: KVLoad, kv_caches: list[KVCache]) -> None:
        """Begin copying `load.remote_block_ids` of `load.source` into this engine's
        `load.local_block_ids`. Every load is reported by `poll` exactly once."""

    @abstractmethod
    def cancel(self, request_id: str) -> None:
        """Stop a load as soon as possible; it is still reported by `poll`."""

    @abstractmethod
    def poll(self) -> list[KVLoadResult]:
        """Loads that ended since the last poll. After a load is reported, nothing of it
        writes into this engine's blocks any more."""

    @abstractmethod
    def close(self) -> None:
        """Stop exporting and release what the transport holds."""


class SynchronousTransport(KVTransport):
    """A transport whose loads end inside `start_load`: their results wait for `poll`,
    and nothing is ever left to cancel."""

    def __init__(self) -> None:
        self._results: list[KVLoadResult] = []

    def cancel(self, request_id: str) -> None:
        pass

    def poll(self) -> list[KVLoadResult]:
        results, self._results = self._results, []
        return results


def copy_blocks(source: list[KVCache], target: list[KVCache], source_ids: list[int], target_ids: list[int]) -> None:
    """Copy whole blocks, every layer, keys and values (and scales of a quantized cache)."""
    src = torch.tensor(source_ids, dtype=torch.int64)
    dst = torch.tensor(target_ids, dtype=torch.int64)
    for source_cache, target_cache in zip(source, target, strict=True):
        for source_tensor, target_tensor in zip(split_kv_cache(source_cache), split_kv_cache(target_cache)):
            if source_tensor is None or target_tensor is None:
                continue
            source_bytes, target_bytes = _cpu_bytes(source_tensor), _cpu_bytes(target_tensor)
            if source_bytes is not None and target_bytes is not None:
                target_bytes[:, dst.numpy()] = source_bytes[:, src.numpy()]
            else:
                target_tensor[:, dst.to(target_tensor.device)] = source_tensor[:, src.to(source_tensor.device)].to(
                    target_tensor.device
                )


def _cpu_bytes(tensor: torch.Tensor) -> np.ndarray | None:
    """A CPU tensor's bytes as a numpy array sharing its memory, or None. numpy gathers and
    scatters whole blocks two to five times faster than torch's advanced indexing, and
    sees every dtype alike as bytes (bfloat16 included)."""
    if tensor.device.type != "cpu" or tensor.stride(-1) != 1:
        return None
    return tensor.view(torch.uint8).numpy()
