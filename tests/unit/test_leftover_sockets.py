"""The sweep of socket folders that killed servers of older versions left: a folder whose
every socket refuses connections goes, and says so; a live server's folder, one of any
other shape, and everything else in the temporary directory stay.

A killed server's socket files are made as SIGKILL leaves them: bound, then closed without
an unlink (ZMQ unlinks on a clean close), so nothing listens on them any more.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cadence.server import leftover_sockets
from cadence.server.leftover_sockets import remove_dead_socket_folders


def dead_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(path))


def socket_folder(tmp: Path, name: str, engines: dict[str, list[str]]) -> Path:
    """A folder as those servers made it: mode 0700, a subfolder per engine, and the dead
    sockets named in `engines`."""
    folder = tmp / name
    folder.mkdir(mode=0o700)
    for engine, sockets in engines.items():
        (folder / engine).mkdir()
        for name in sockets:
            dead_socket(folder / engine / name)
    return folder


@pytest.fixture()
def listeners() -> Iterator[list[socket.socket]]:
    """Sockets a test binds and listens on (a live server's); closed at the end."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def listen(path: Path, opened: list[socket.socket]) -> None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    opened.append(sock)
    sock.bind(str(path))
    sock.listen()


def test_only_folders_of_dead_servers_go(
    tmp_path: Path, listeners: list[socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    dead = socket_folder(tmp_path, "cadence-dead0001", {"engine": ["inputs-1", "outputs-1"]})
    dead_disaggregated = socket_folder(
        tmp_path, "cadence-dead0002", {"prefill-0": ["inputs-3", "outputs-3"], "decode-0": ["inputs-1", "outputs-1"]}
    )
    live = socket_folder(tmp_path, "cadence-live0001", {"engine": []})
    listen(live / "engine" / "inputs-2", listeners)
    listen(live / "engine" / "outputs-2", listeners)
    # One engine dead and restarting, the other serving: the server lives.
    half_live = socket_folder(tmp_path, "cadence-live0002", {"prefill-0": ["inputs-1"], "decode-0": []})
    listen(half_live / "decode-0" / "inputs-1", listeners)
    # Between two starts of its engine a live server may hold no socket at all.
    empty = socket_folder(tmp_path, "cadence-empt0001", {"engine": []})
    foreign_file = socket_folder(tmp_path, "cadence-othr0001", {"engine": ["inputs-1"]})
    (foreign_file / "engine" / "notes.txt").write_text("not ours")
    foreign_engine = socket_folder(tmp_path, "cadence-othr0002", {"worker": ["inputs-1"]})
    open_mode = socket_folder(tmp_path, "cadence-othr0003", {"engine": ["inputs-1"]})
    open_mode.chmod(0o755)
    other_name = socket_folder(tmp_path, "cadence-longername", {"engine": ["inputs-1"]})
    elsewhere = socket_folder(tmp_path, "elsewhere", {"engine": ["inputs-1"]})
    link = tmp_path / "cadence-link0001"
    link.symlink_to(elsewhere)
    log = tmp_path / "cadence-test-server-4242.log"
    log.write_text("a test server's log")

    with caplog.at_level(logging.INFO, logger=leftover_sockets.__name__):
        removed = remove_dead_socket_folders(str(tmp_path), pause=0.0)

    assert sorted(removed) == [str(dead), str(dead_disaggregated)]
    assert not dead.exists() and not dead_disaggregated.exists()
    for kept in (live, half_live, empty, foreign_file, foreign_engine, open_mode, other_name, elsewhere, link, log):
        assert os.path.lexists(kept), f"{kept} was removed"
    assert (elsewhere / "engine" / "inputs-1").exists()
    assert (live / "engine" / "inputs-2").exists()
    messages = [record.getMessage() for record in caplog.records]
    assert any(str(dead) in m and "2 sockets" in m for m in messages), messages
    assert any(str(dead_disaggregated) in m and "4 sockets" in m for m in messages), messages


def test_a_folder_that_changes_during_the_pause_stays(
    tmp_path: Path, listeners: list[socket.socket], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A live server of an older version closes one start's sockets just before it deletes
    them and binds the next start's: in between, every socket refuses."""
    folder = socket_folder(tmp_path, "cadence-rest0001", {"engine": ["inputs-1", "outputs-1"]})

    def server_restarts_its_engine(seconds: float) -> None:
        for name in ("inputs-1", "outputs-1"):
            (folder / "engine" / name).unlink()
        listen(folder / "engine" / "inputs-2", listeners)

    monkeypatch.setattr(leftover_sockets.time, "sleep", server_restarts_its_engine)
    assert remove_dead_socket_folders(str(tmp_path)) == []
    assert (folder / "engine" / "inputs-2").exists()


def test_nothing_to_sweep_takes_no_pause(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_pause(seconds: float) -> None:
        raise AssertionError("paused with no suspect")

    monkeypatch.setattr(leftover_sockets.time, "sleep", no_pause)
    (tmp_path / "cadence-test-server-1.log").write_text("")
    assert remove_dead_socket_folders(str(tmp_path)) == []
    assert remove_dead_socket_folders(str(tmp_path / "missing")) == []
