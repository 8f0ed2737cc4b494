"""How much memory the host has: its total (a fact of the machine, which budgets are cut
from) and what is available at the moment.

The KV-cache sizing of ``kv_cache_size.py`` and the CPU kernel planner's budget for kept
weight copies both read it.
"""

from __future__ import annotations

GiB = 1 << 30


def available_host_memory() -> int:
    """MemAvailable from /proc/meminfo, or a conservative guess where there is none."""
    return _meminfo("MemAvailable:") or 4 * GiB


def total_host_memory() -> int:
    """The memory this process's machine has: MemTotal, or the cgroup's limit where that
    is lower (a container's). A fact of the machine, unlike what is free at the moment."""
    total = _meminfo("MemTotal:") or 4 * GiB
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path, encoding="ascii") as f:
                limit = f.read().strip()
        except OSError:
            continue
        if limit.isdigit():
            total = min(total, int(limit))
    return total


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo field in bytes, or None where there is none."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
