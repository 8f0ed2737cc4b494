"""The KV transports by name."""

from __future__ import annotations

from cadence.engine.kv_transfer.transport import KVTransport

KV_TRANSPORTS = ("in-process", "shared-memory", "nixl", "tcp")


def validate_kv_transport(name: str) -> None:
    if name not in KV_TRANSPORTS:
        raise ValueError(f"unknown kv_transport {name!r}; use {', '.join(KV_TRANSPORTS)}")


def create_kv_transport(name: str, exporting: bool, host: str = "127.0.0.1") -> KVTransport:
    """A fresh transport of the named kind (imported on use: some need native libraries);
    `exporting` for a prefill engine, whose caches others read; `host` is where a "tcp"
    exporter binds and the address readers connect to."""
    validate_kv_transport(name)
    if name == "shared-memory":
        from cadence.engine.kv_transfer.shared_memory import SharedMemoryTransport

        return SharedMemoryTransport(exporting=exporting)
    if name == "nixl":
        from cadence.engine.kv_transfer.nixl import NixlTransport

        return NixlTransport(exporting=exporting)
    if name == "tcp":
        from cadence.engine.kv_transfer.tcp import TcpTransport

        return TcpTransport(exporting=exporting, host=host)
    from cadence.engine.kv_transfer.in_process import InProcessTransport

    return InProcessTransport()
