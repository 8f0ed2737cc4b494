"""The socket folders that servers killed outright left in the temporary directory: a
server at start removes those it can prove dead.

Servers before abstract-namespace addresses (server/ipc_addresses.py) bound their engine
sockets as files: a folder `cadence-XXXXXXXX` (`tempfile.mkdtemp`, mode 0700), one
subfolder per engine (`engine`, `prefill-0`, `decode-1`, ...) and in it `inputs-N` and
`outputs-N` per start of that engine. A clean exit removed the folder; a SIGKILL left it.

The folder names no process, so its server cannot be proven dead by a pid. A socket file
can: a connection to it is refused once no socket is bound to it, and a bound socket
accepts (or, with its queue full, asks to wait) however busy or stopped its process is.
A folder goes only when all of these hold, and anything unexpected keeps it:

- it is a real folder of that name and mode, owned by this user, holding only engine
  subfolders that hold only socket files of those names, all owned by this user;
- it holds at least one socket, and every one refuses a connection (a live server
  between two starts of its engine may have none: that proves nothing);
- the same is true after a pause, with not one entry changed: a live server closes one
  start's sockets (refused) just before it deletes them and binds the next start's.

Removal unlinks the sockets and removes the (then empty) folders one by one, never a
tree, so a file that appeared meanwhile stops it.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import socket
import stat
import tempfile
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

# mkdtemp's names: the prefix, then 8 of its characters.
_FOLDER = re.compile(r"cadence-[a-z0-9_]{8}")
_ENGINE = re.compile(r"(engine|prefill|decode)(-[0-9]+)?")
_SOCKET = re.compile(r"(inputs|outputs)-[0-9]+")
# Seconds between the two looks at a folder; a live server unlinks what it closed within microseconds.
PAUSE = 1.0


@dataclass(frozen=True)
class _Entry:
    path: str
    is_folder: bool
    mode: int  # the permission bits
    inode: int
    mtime_ns: int


def remove_dead_socket_folders(directory: str | None = None, pause: float = PAUSE) -> list[str]:
    """Remove the socket folders in `directory` (the temporary directory, where those
    servers made them) that belonged to servers proven dead; the folders removed."""
    directory = directory or tempfile.gettempdir()
    try:
        names = sorted(name for name in os.listdir(directory) if _FOLDER.fullmatch(name))
    except OSError:
        return []
    suspects = {}
    for name in names:
        entries = _dead_folder(os.path.join(directory, name))
        if entries is not None:
            suspects[name] = entries
    if not suspects:
        return []
    time.sleep(pause)
    removed = []
    for name, entries in suspects.items():
        folder = os.path.join(directory, name)
        if _dead_folder(folder) == entries and _remove(folder, entries):
            sockets = sum(not entry.is_folder for entry in entries)
            logger.info(
                "removed %s: the engine sockets of a server that is gone (none of its %d sockets accepts a connection)",
                folder,
                sockets,
            )
            removed.append(folder)
    return removed


def _dead_folder(folder: str) -> list[_Entry] | None:
    """The folder's entries, folders first, when it has the shape described above and
    none of its sockets accepts a connection; None when anything says otherwise."""
    top = _entry(folder)
    if top is None or not top.is_folder or top.mode != 0o700:
        return None
    folders, sockets = [top], []
    try:
        for engine in sorted(os.listdir(folder)):
            engine_path = os.path.join(folder, engine)
            entry = _entry(engine_path) if _ENGINE.fullmatch(engine) else None
            if entry is None or not entry.is_folder:
                return None
            folders.append(entry)
            for name in sorted(os.listdir(engine_path)):
                path = os.path.join(engine_path, name)
                entry = _entry(path) if _SOCKET.fullmatch(name) else None
                if entry is None or entry.is_folder:
                    return None
                sockets.append(entry)
        if not sockets or not all(_refuses(entry.path) for entry in sockets):
            return None
    except OSError:
        return None
    return folders + sockets


def _entry(path: str) -> _Entry | None:
    """`path` when it is a folder or a socket of this user's (never a link); else None."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if info.st_uid != os.geteuid() or not (stat.S_ISDIR(info.st_mode) or stat.S_ISSOCK(info.st_mode)):
        return None
    return _Entry(path, stat.S_ISDIR(info.st_mode), stat.S_IMODE(info.st_mode), info.st_ino, info.st_mtime_ns)


def _refuses(path: str) -> bool:
    """Whether a connection to the socket file `path` is refused: nothing is bound to it.
    Anything else (accepted, a full queue, an error) counts as alive."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(path)
        except OSError as error:
            return error.errno == errno.ECONNREFUSED
    return False


def _remove(folder: str, entries: list[_Entry]) -> bool:
    """Unlink the sockets, then remove the folders, deepest first; whether all went."""
    try:
        for entry in reversed(entries):
            if entry.is_folder:
                os.rmdir(entry.path)
            else:
                os.unlink(entry.path)
    except FileNotFoundError:
        return False  # another server starting beside this one is removing it
    except OSError as error:
        logger.warning("left %s as it is: %s", folder, error)
        return False
    return True
