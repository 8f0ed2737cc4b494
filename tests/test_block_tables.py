"""The host block-table mirrors (engine/block_tables.py) against tables built whole.

Sentinels (-1) in entries a refresh must not need show what each write touched; the real
scheduler under random traffic, with its steps split between the eager path and the
decode graphs, checks every table against the lists themselves.
"""
from __future__ import annotations

import random

import numpy as np
import pytest

from cadence.engine import block_tables
from cadence.engine.block_tables import EagerBlockTables, TableRows
from cadence.scheduler.request import Request, StopConditions
from cadence.scheduler.scheduler import CacheConfig, Scheduler, SchedulerConfig

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


class _Walk:
    """The real Scheduler and KVCacheManager under random traffic: shared prefixes (prefix
    cache hits), n > 1 forks, aborts, a pool small enough to preempt, reused request ids and
    token budgets down to 3 (one-token prompt chunks). Each step goes, as in
    ``ModelRunner.execute``, to the graph rows (only when every row decodes one token, and
    then at random) or to the eager mirrors, and every table is checked against the lists."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=self.rng.choice([3, 8, 20]),
                                 max_model_len=160)
        self.scheduler = Scheduler(config, CacheConfig(num_blocks=60, block_size=BLOCK_SIZE))
        self.prefixes = [[self.rng.randrange(1, 50) for _ in range(self.rng.randrange(1, 30))] for _ in range(3)]
        self.eager = EagerBlockTables()
        self.graph_table = np.full((8, 64), -1, dtype=np.int32)
        self.graph_rows = TableRows(self.graph_table)
        self.arrivals = 0
        self.steps = {"eager": 0, "graph": 0}

    def _add(self, request_id: str, prompt: list[int], parent: str | None) -> None:
        self.arrivals += 1
        stop = StopConditions(max_tokens=self.rng.randrange(1, 60), stop_token_ids=frozenset({0}))
        self.scheduler.add_request(Request(request_id, list(prompt), stop, self.arrivals,
                                           priority=self.rng.randrange(2), fork_parent_id=parent))

    def _arrive(self) -> None:
        rng, requests = self.rng, self.scheduler.requests
        base = f"q{rng.randrange(20)}"  # ids come back once their request is gone
        prompt = rng.choice(self.prefixes) + [rng.randrange(1, 50) for _ in range(rng.randrange(12))]
        if rng.random() < 0.3:  # n > 1: the later siblings fork the first
            ids = [f"{base}#{i}" for i in range(rng.randint(2, 3))]
            if not any(i in requests for i in ids):
                for k, request_id in enumerate(ids):
                    self._add(request_id, prompt, ids[0] if k else None)
        elif base not in requests:
            self._add(base, prompt, None)

    def step(self) -> None:
        rng, scheduler = self.rng, self.scheduler
        if len(scheduler.requests) < 8 and rng.random() < 0.4:
            self._arrive()
        if scheduler.requests and rng.random() < 0.03:
            scheduler.abort_requests([rng.choice(list(scheduler.requests))])
        output = scheduler.schedule()
        items = sorted(output.scheduled, key=lambda s: (s.num_new_tokens != 1, s.request.num_computed_tokens))
        rows = [(s.request.request_id, s.request.block_ids, s.request.num_computed_tokens // BLOCK_SIZE)
                for s in items]
        if rows and all(s.num_new_tokens == 1 for s in items) and rng.random() < 0.6:
            for i, (_, held, write_block) in enumerate(rows):
                self.graph_rows.write(i, held, write_block)
                assert self.graph_table[i, : len(held)].tolist() == held
            padded = next(b for b in (1, 2, 4, 8) if b >= len(rows))
            self.graph_table[len(rows) : padded, 0] = 0  # padding rows, as DecodeGraphs writes them
            self.graph_rows.forget(len(rows), padded)
            self.steps["graph"] += 1
        elif rows:
            table = self.eager.build(rows)
            assert table.dtype == np.int64 and table.shape == (len(rows), max(len(h) for _, h, _ in rows))
            for i, (_, held, _) in enumerate(rows):
                assert table[i, : len(held)].tolist() == held and not table[i, len(held) :].any()
            self.steps["eager"] += 1
        scheduler.update(output, {s.request.request_id: rng.randrange(50) for s in output.scheduled if s.samples})


@pytest.mark.parametrize("direct_max_blocks", [0, 2])
def test_mirrors_match_the_lists_under_the_real_scheduler(monkeypatch, direct_max_blocks: int) -> None:
    monkeypatch.setattr(block_tables, "DIRECT_MAX_BLOCKS", direct_max_blocks)  # 2: both kinds of row
    steps = {"eager": 0, "graph": 0}
    for seed in range(30):
        walk = _Walk(seed)
        for _ in range(400):
            walk.step()
        for path, count in walk.steps.items():
            steps[path] += count
    assert min(steps.values()) > 1000  # both paths, interleaved, many times
