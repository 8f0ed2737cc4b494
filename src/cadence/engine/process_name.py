"""Names for Cadence's processes, as ps and top show them."""

from __future__ import annotations

ENGINE = "cadence-engine"
# Engines of a disaggregated server, by role (prefill and decode workers).
ROLE_NAMES = {"colocated": ENGINE, "prefill": "cadence-prefill", "decode": "cadence-decode"}


def name_this_process(name: str) -> None:
    """Show `name` for this process (Linux keeps 15 characters; elsewhere nothing happens).

    A process started by multiprocessing's spawn would otherwise look like any other
    Python; operators and tests find the engine by this name.
    """
    try:
        with open("/proc/self/comm", "w", encoding="ascii") as comm:
            comm.write(name[:15])
    except OSError:
        pass
