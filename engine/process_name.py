"""Names for Cadence's processes, as ps and top show them."""

from __future__ import annotations

ENGINE = "cadence-engine"
TOKENIZER = "cadence-tokens"


def name_this_process(name: str) -> None:
    """Show `name` for this process (Linux keeps 15 characters; elsewhere nothing happens).

    Every helper process is started by multiprocessing's spawn and would otherwise look
    the same; operators and tests tell the engine from a tokenizer worker by this name.
    """
    try:
        with open("/proc/self/comm", "w", encoding="ascii") as comm:
            comm.write(name[:15])
    except OSError:
        pass
