"""Host copies of the requests' block lists, rewritten each step only where they may differ.

Rebuilding every sequence's whole block table from its Python list costs O(all blocks
held) each step: at batch 256 with 32k-token contexts (2,048 blocks each) that was 50 ms
of host time for an eager step on this project's CPU, and 16 ms for the decode graphs'
rows. A copy that last mirrored the same request's block list (the list object itself,
kept referenced so its identity cannot be reused) needs rewriting only from the block
that copy's step wrote.

That rests on how the scheduler edits a list (``KVCacheManager``'s docstring): blocks
before the one a step writes are full and never change; copy-on-write replaces only the
block a step writes into; new blocks are appended; a cached prefix only joins an empty
list; and preemption, finishing and forking give a request a new list. For one list
object the write block only moves forward, so every block that steps the copy did not
see (decode graphs and eager steps each mirror only their own steps) could have swapped
lies at or after the block the copy's own step wrote. That matters: a request forked
for n > 1 shares its partly filled last prompt block and swaps it in its next step,
which either path may run while the other holds the older copy.

* ``TableRows``: the decode graphs' fixed host table, one row per batch slot.
* ``EagerBlockTables``: each eager step's ``[batch, width]`` table, from one mirror per
  running request.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Up to this many blocks a list is copied whole: numpy takes a short list (~1 us for 32)
# faster than a mirror is looked up and refreshed (~1.4 us), measured by bench/block_tables.py.
DIRECT_MAX_BLOCKS = 32


def first_stale_block(mirrored: list[int] | None, written: int, mirrored_write: int,
                      block_ids: list[int], write_block: int) -> int:
    """Where a copy of ``mirrored``'s first ``written`` blocks, taken by a step that wrote
    block ``mirrored_write``, may first differ from ``block_ids``, which this step writes
    from block ``write_block``."""
    if mirrored is block_ids and len(block_ids) >= written:
        # write_block >= mirrored_write for one list; taking it too costs nothing.
        return min(mirrored_write, write_block, written)
    return 0


class TableRows:
    """The decode graphs' host rows (numpy int32 ``[rows, max_blocks]``), kept per row."""

    def __init__(self, table: np.ndarray) -> None:
        self.table = table
        self._lists: list[list[int] | None] = [None] * table.shape[0]
        self._written = [0] * table.shape[0]
        self._write_blocks = [0] * table.shape[0]

    def write(self, row: int, block_ids: list[int], write_block: int) -> None:
        """Row `row` holds `block_ids`; the step writes KV into block `write_block`."""
        if len(block_ids) <= DIRECT_MAX_BLOCKS:
            self.table[row, : len(block_ids)] = block_ids
            self._lists[row] = None
            return
        first = first_stale_block(self._lists[row], self._written[row], self._write_blocks[row], block_ids, write_block)
        self.table[row, first : len(block_ids)] = block_ids[first:]
        self._lists[row] = block_ids
        self._written[row] = len(block_ids)
        self._write_blocks[row] = write_block

    def forget(self, start: int, stop: int) -> None:
        """Rows start..stop-1 were overwritten (padding): write them whole next time."""
        for row in range(start, stop):
            self._lists[row] = None


@dataclass
class _Mirror:
    block_ids: list[int]  # the request's list, referenced so its identity stays unique
    values: np.ndarray  # int64, room to grow; the first `written` entries are the copy
    written: int
    write_block: int  # the block the copy's step wrote first


class EagerBlockTables:
    """Each eager step's block table, from a mirror per request of that step.

    A request missing from a step loses its mirror (it was preempted, finished or left
    waiting), so the mirrors never outnumber one step's batch. Short lists are copied
    whole and keep none.
    """

    def __init__(self) -> None:
        self._mirrors: dict[str, _Mirror] = {}

    def build(self, rows: list[tuple[str, list[int], int]]) -> np.ndarray:
        """int64 ``[len(rows), longest list]``, zero-padded, from ``(request id, block
        ids, block the step writes first)`` per sequence."""
        width = max((len(block_ids) for _, block_ids, _ in rows), default=0)
        table = np.zeros((len(rows), width), dtype=np.int64)
        mirrors: dict[str, _Mirror] = {}
        for i, (request_id, block_ids, write_block) in enumerate(rows):
            if len(block_ids) <= DIRECT_MAX_BLOCKS:
                table[i, : len(block_ids)] = block_ids
                continue
            mirror = self._refresh(self._mirrors.get(request_id), block_ids, write_block)
            table[i, : mirror.written] = mirror.values[: mirror.written]
            mirrors[request_id] = mirror
        self._mirrors = mirrors
        return table

    @staticmethod
    def _refresh(mirror: _Mirror | None, block_ids: list[int], write_block: int) -> _Mirror:
        count = len(block_ids)
        if mirror is None:
            mirror = _Mirror(block_ids, np.empty(count, dtype=np.int64), 0, 0)
        first = first_stale_block(mirror.block_ids, mirror.written, mirror.write_block, block_ids, write_block)
        if count > mirror.values.size:  # doubling, so a growing context copies O(1) per block
            grown = np.empty(max(count, 2 * mirror.values.size), dtype=np.int64)
            grown[:first] = mirror.values[:first]
            mirror.values = grown
        mirror.values[first:count] = block_ids[first:]
        mirror.block_ids, mirror.written, mirror.write_block = block_ids, count, write_block
        return mirror
