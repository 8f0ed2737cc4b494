"""Where a prefill engine's KV blocks are read from: the address that crosses processes.

Torch-free, so the process-boundary messages (engine/protocol.py) carry it without the
API process loading torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.engine.kv_transfer.layout import KVLayout


@dataclass(frozen=True)
class KVSource:
    """Where an engine's blocks can be read from: the transport that exported them, its
    address for them, and their layout. It crosses processes; no tensor is inside."""

    transport: str
    address: str
    layout: KVLayout
