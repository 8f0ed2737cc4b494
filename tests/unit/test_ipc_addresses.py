"""The engine sockets' addresses: abstract names that vanish with their sockets, open only
to the server's user."""

from __future__ import annotations

import os

import pytest
import zmq

from cadence.server.ipc_addresses import address_prefix, bind_for_this_user

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/unix"), reason="needs Linux")


def listed(name: str) -> bool:
    with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
        return any(line.split()[-1] == name for line in f if len(line.split()) > 7)


def send_from(address: str, uid: int | None) -> int:
    """Fork a process (running as `uid` when given) that sends one message to `address`; its pid."""
    pid = os.fork()
    if pid == 0:  # the child: never returns to pytest
        try:
            if uid is not None:
                os.setuid(uid)
            with zmq.Context() as context, context.socket(zmq.PUSH) as push:
                push.setsockopt(zmq.LINGER, 3000)
                push.connect(address)
                push.send(b"hello", flags=zmq.NOBLOCK)
        finally:
            os._exit(0)
    return pid


def test_an_address_names_the_server_and_vanishes_with_its_socket() -> None:
    prefix = address_prefix()
    assert prefix.startswith(f"@cadence-{os.getpid()}-")
    assert prefix != address_prefix()  # a random part: servers never share names
    name = f"{prefix}-engine-inputs-1"
    with zmq.Context() as context:
        pull = context.socket(zmq.PULL)
        bind_for_this_user(pull, f"ipc://{name}")
        assert listed(name)
        pid = send_from(f"ipc://{name}", None)
        try:
            assert pull.poll(30_000), "this user's process could not reach the socket"
            assert pull.recv() == b"hello"
        finally:
            os.waitpid(pid, 0)
        pull.close(linger=0)
    assert not listed(name)


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_another_user_cannot_reach_the_engine_sockets() -> None:
    name = f"ipc://{address_prefix()}-engine-outputs-1"
    with zmq.Context() as context, context.socket(zmq.PULL) as pull:
        bind_for_this_user(pull, name)
        pid = send_from(name, 65534)  # nobody
        _, status = os.waitpid(pid, 0)  # it lingers up to 3 s to deliver, then exits
        assert os.waitstatus_to_exitcode(status) == 0
        assert not pull.poll(500), "a process of another user delivered a message"
        pull.close(linger=0)
