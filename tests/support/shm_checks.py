"""Who still holds a prefill engine's shared-memory KV, read from /proc.

The shared-memory transport keeps KV in memfds named `cadence-kv-<pid>-<uuid>-<n>`. The
kernel frees one once no process holds it open or mapped, so "nothing is left" means: no
process (that this one may inspect) holds a descriptor of it or maps it, and no file of
that name lies in /dev/shm.
"""

from __future__ import annotations

import glob
import os


def _memfd(prefix: str) -> str:
    return f"/memfd:{prefix}"


def descriptors(pid: int, prefix: str) -> int:
    """How many of process `pid`'s open descriptors are memfds named `prefix...`."""
    count = 0
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return 0
    for fd in fds:
        try:
            count += os.readlink(f"/proc/{pid}/fd/{fd}").startswith(_memfd(prefix))
        except OSError:
            continue  # closed meanwhile
    return count


def mappings(pid: int, prefix: str) -> int:
    """How many of process `pid`'s memory mappings are of memfds named `prefix...`."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            return sum(_memfd(prefix) in line for line in f)
    except OSError:
        return 0


def holders(prefix: str) -> set[int]:
    """The processes that hold open or map a memfd named `prefix...`."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (mappings(int(entry), prefix) or descriptors(int(entry), prefix)):
            found.add(int(entry))
    return found


def dev_shm_files(pids: list[int]) -> list[str]:
    """KV files in /dev/shm named after any of `pids` (what an older transport left)."""
    return [path for pid in pids for path in glob.glob(f"/dev/shm/cadence-kv-{pid}-*")]
