"""The host block-table mirrors (engine/block_tables.py) against tables built whole.

Sentinels (-1) in entries a refresh must not need show what each write touched; a
simulation that edits block lists the way the scheduler does, with steps split between
the eager path and the decode graphs, checks every table against the lists themselves.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from cadence.engine import block_tables
from cadence.engine.block_tables import EagerBlockTables, TableRows

BLOCK_SIZE = 4


@pytest.fixture
def mirror_every_list(monkeypatch) -> None:
    """Mirrors even for the short lists these tests use (longer ones are copied whole)."""
    monkeypatch.setattr(block_tables, "DIRECT_MAX_BLOCKS", 0)


def test_table_rows_rewrite_a_row_from_the_block_its_last_step_wrote(mirror_every_list) -> None:
    table = np.full((2, 8), -7, dtype=np.int32)
    rows = TableRows(table)
    held = [10, 11]
    rows.write(0, held, 1)
    assert table[0, :2].tolist() == [10, 11]
    table[0, :2] = -1
    held.append(12)  # the same request's list grows a block: written from the write block
    rows.write(0, held, 2)
    assert table[0, :3].tolist() == [-1, 11, 12]  # block 1 was the last step's write block
    table[0, :3] = -1
    held[2] = 20  # copy-on-write swaps the block being written, in place
    rows.write(0, held, 2)
    assert table[0, :3].tolist() == [-1, -1, 20]
    table[0, :3] = -1
    held[2] = 21  # eager steps since: one swapped block 2, then two blocks came
    held += [13, 14]
    rows.write(0, held, 4)
    assert table[0, :5].tolist() == [-1, -1, 21, 13, 14]
    rows.write(0, list(held), 4)  # an equal list that is another object (preempted, re-admitted)
    assert table[0, :5].tolist() == held
    table[0, :] = 0  # padding overwrote the row
    rows.forget(0, 1)
    rows.write(0, [30, 31], 1)
    rows.write(1, held, 4)  # a list moves to another row: that row is written whole
    assert table[0, :2].tolist() == [30, 31] and table[1, :5].tolist() == held


def test_eager_tables_pad_and_follow_each_request(mirror_every_list) -> None:
    tables = EagerBlockTables()
    a, b = [1, 2, 3], [7]
    assert tables.build([("a", a, 0), ("b", b, 0)]).tolist() == [[1, 2, 3], [7, 0, 0]]
    assert tables.build([]).shape == (0, 0)
    # "a" and "b" were missing from the last step: their mirrors went with it.
    a.append(4)
    assert tables.build([("b", b, 0), ("a", a, 3)]).tolist() == [[7, 0, 0, 0], [1, 2, 3, 4]]
    b.extend(range(100, 140))  # past the mirror's first capacity of 16
    table = tables.build([("b", b, 0)])
    assert table.dtype == np.int64 and table[0].tolist() == b


def test_forked_parents_swapped_block_reaches_a_later_eager_step(mirror_every_list) -> None:
    """A parent's last prompt block is shared with its n > 1 siblings; its first decode,
    replayed from a graph, swaps the block; eager steps resume after the block filled."""
    tables = EagerBlockTables()
    parent = [1, 2, 3]  # 10 prompt tokens: block 2 half full
    tables.build([("p", parent, 0)])
    parent[2] = 9  # copy-on-write in the unseen graph step that wrote block 2
    parent.append(4)  # more unseen decode steps filled it and started block 3
    assert tables.build([("p", parent, 3)])[0].tolist() == [1, 2, 9, 4]


def _random_walk(seed: int, steps: int = 300) -> None:
    """Requests prefill in chunks, decode, swap their write block, get preempted and
    finish; each step runs eagerly or through the graph rows, and both must match."""
    rng = random.Random(seed)
    fresh = iter(range(1000, 10**6))
    lists: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    eager = EagerBlockTables()
    graph_table = np.full((8, 64), -1, dtype=np.int32)
    graph_rows = TableRows(graph_table)
    for step in range(steps):
        while len(lists) < 5:
            request_id = f"r{rng.randrange(12)}"  # ids come back after their request ends
            if request_id not in lists:
                lists[request_id], computed[request_id] = [], 0
        scheduled = [r for r in lists if rng.random() < 0.8]
        rng.shuffle(scheduled)
        rows = []
        for request_id in scheduled:
            held, start = lists[request_id], computed[request_id]
            new = rng.randint(1, 9) if start < 12 else 1
            write_block = start // BLOCK_SIZE
            if write_block < len(held) and rng.random() < 0.3:
                held[write_block] = next(fresh)  # copy-on-write of a shared block
            held.extend(next(fresh) for _ in range(-(-(start + new) // BLOCK_SIZE) - len(held)))
            computed[request_id] = start + new
            rows.append((request_id, held, write_block))
        if rows and (step % 3 == 0 or any(computed[r] <= 12 for r, _, _ in rows)):
            table = eager.build(rows)
            assert table.shape == (len(rows), max(len(held) for _, held, _ in rows))
            for i, (_, held, _) in enumerate(rows):
                assert table[i, : len(held)].tolist() == held and not table[i, len(held) :].any()
        elif rows:
            for i, (_, held, write_block) in enumerate(rows):
                graph_rows.write(i, held, write_block)
                assert graph_table[i, : len(held)].tolist() == held
            graph_table[len(rows) :, 0] = 0  # padding rows, as DecodeGraphs writes them
            graph_rows.forget(len(rows), graph_table.shape[0])
        for request_id in list(lists):
            roll = rng.random()
            if roll < 0.04 or len(lists[request_id]) * BLOCK_SIZE > 200:
                del lists[request_id], computed[request_id]  # finished
            elif roll < 0.08:
                lists[request_id], computed[request_id] = [], 0  # preempted: a new list


@pytest.mark.parametrize("direct_max_blocks", [0, 6])
def test_mirrors_match_the_lists_through_scheduler_like_edits(monkeypatch, direct_max_blocks: int) -> None:
    monkeypatch.setattr(block_tables, "DIRECT_MAX_BLOCKS", direct_max_blocks)  # 6: both kinds of row
    for seed in range(20):
        _random_walk(seed)
