"""Which process a pid is: its start time, so that a reused pid is not mistaken for it.

A pid alone names whichever process holds it now; a process that died may have handed
its pid to an unrelated one. The pid with the start time (clock ticks after boot, field 22
of /proc/<pid>/stat) names one process for the life of the machine.
"""

from __future__ import annotations

import os


def start_time(pid: int) -> int | None:
    """When process `pid` started, or None where there is no such live process (gone, a
    zombie whose memory and files are released already, or no /proc to ask)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            # The command name, in parentheses, may hold spaces and parentheses itself.
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def own_start_time() -> int:
    """This process's start time; OSError where /proc does not say it."""
    started = start_time(os.getpid())
    if started is None:
        raise OSError("cannot read this process's start time from /proc")
    return started
