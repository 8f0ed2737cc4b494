"""The KV transports by name."""

from __future__ import annotations

from cadence.engine.kv_transfer.transport import KVTransport

KV_TRANSPORTS = ("in-process",)


def validate_kv_transport(name: str) -> None:
    if name not in KV_TRANSPORTS:
        raise ValueError(f"unknown kv_transport {name!r}; use {', '.join(KV_TRANSPORTS)}")


def create_kv_transport(name: str) -> KVTransport:
    """A fresh transport of the named kind (imported on use: some need native libraries)."""
    validate_kv_transport(name)
    from cadence.engine.kv_transfer.in_process import InProcessTransport

    return InProcessTransport()
