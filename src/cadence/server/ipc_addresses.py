"""Where the server meets its engine processes: ZMQ ipc sockets in Linux's abstract
namespace.

An abstract address (`ipc://@name`) is a name the kernel keeps while a socket is bound to
it, not a file: it vanishes with the socket however its process ends, SIGKILL and the OOM
killer included. Socket files in a temporary folder outlived every crash of the server.
The server needs Linux anyway (CPU affinity, /proc), so there is no file-based fallback.

An abstract name has no file permissions: any process in the same network namespace may
connect to it. Each bound socket therefore accepts only peers running as this process's
user (ZMQ checks the kernel's peer credentials), as the private folder's mode did.
"""

from __future__ import annotations

import os
import secrets

import zmq


def address_prefix() -> str:
    """A prefix for this server's engine addresses: its pid, for whoever reads
    /proc/net/unix, and a random part, so that servers whose pids coincide (in other pid
    namespaces sharing this network namespace) never take each other's names."""
    return f"@cadence-{os.getpid()}-{secrets.token_hex(6)}"


def bind_for_this_user(socket: zmq.Socket, address: str) -> None:
    """Bind `socket` to `address`, letting only processes of this user connect."""
    try:
        socket.setsockopt(zmq.IPC_FILTER_UID, os.geteuid())
    except zmq.ZMQError as error:
        raise RuntimeError(
            f"libzmq {zmq.zmq_version()} cannot limit ipc peers to this user ({error}); "
            "use a pyzmq wheel, whose bundled libzmq can"
        ) from error
    socket.bind(address)
