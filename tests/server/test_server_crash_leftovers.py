"""A colocated server killed outright leaves nothing behind, and the next one sweeps what
older servers left and gets the same KV cache.

SIGKILL reaches the server's whole process group (the API process and its engine), as the
OOM killer or a node drain would end them: no handler or exit hook runs. The server runs
with a temporary directory of its own, so "nothing left" is exact: that directory stays
empty, and no abstract socket named after the server remains in /proc/net/unix.
"""

from __future__ import annotations

import os
import re
import signal
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.server_checks import MODEL
from tests.support.server_harness import ServerProcess, group_members, pid_alive, wait_until

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/unix"), reason="needs Linux")

FLAGS = ("--served-model-name", MODEL, "--log-level", "info")


def abstract_sockets(server_pid: int) -> list[str]:
    """The abstract-namespace socket names of `server_pid`'s engines (named after it)."""
    with open("/proc/net/unix", encoding="utf-8", errors="replace") as f:
        return [line.split()[-1] for line in f if f" @cadence-{server_pid}-" in line]


def kv_blocks(server: ServerProcess) -> int:
    with open(server.log_path, encoding="utf-8", errors="replace") as f:
        found = re.search(r"ready on \S+ \(\S+\): (\d+) KV blocks", f.read())
    assert found is not None, server.log()
    return int(found.group(1))


def dead_socket_folder(tmp: Path) -> Path:
    """What a killed server of an older version left: its engine sockets as files."""
    folder = tmp / "cadence-k1lled00"
    (folder / "engine").mkdir(parents=True, mode=0o700)
    folder.chmod(0o700)
    for name in ("inputs-1", "outputs-1"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.bind(str(folder / "engine" / name))
    return folder


def test_a_killed_server_leaves_nothing_and_the_next_sweeps_older_leftovers(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    model = tiny_model_dir("llama")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    server = ServerProcess(model, *FLAGS, env=env, new_group=True)
    members: list[int] = []
    try:
        pid = server.process.pid
        assert len(abstract_sockets(pid)) >= 2, "the engine's sockets are not where this test looks"
        first_blocks = kv_blocks(server)
        members = group_members(pid)
        assert {pid, server.engine_pid} <= set(members)
        os.killpg(pid, signal.SIGKILL)
        server.process.wait(60)
        wait_until(lambda: not any(pid_alive(p) for p in members), 60, f"{members} outlived SIGKILL")
    finally:
        server.stop()
    wait_until(lambda: not abstract_sockets(pid), 30, f"sockets outlived the server: {abstract_sockets(pid)}")
    assert sorted(os.listdir(tmp)) == [], "the killed server left files in its temporary directory"

    leftover = dead_socket_folder(tmp)
    with ServerProcess(model, *FLAGS, env=env) as fresh:
        wait_until(lambda: not leftover.exists(), 30, f"{leftover} was not swept:\n{fresh.log()}")
        assert f"removed {leftover}" in fresh.log()
        assert kv_blocks(fresh) == first_blocks
