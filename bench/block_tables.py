"""Host time to build a step's block tables: whole rows from the lists against the mirrors.

    python bench/block_tables.py
    python bench/block_tables.py --batch 64 256 --blocks 8 128 512 2048 --steps 32

Simulates decode at a steady state: every sequence holds `blocks` 16-token blocks, writes
into its last one, and one sequence in 16 starts a new block each step. For each size it
times, alternating in one process:

* eager, before: the padded `torch.tensor` of Python lists `model_runner` built;
* eager, now: `EagerBlockTables.build` plus `torch.from_numpy`;
* graph rows, before: each whole list copied into the numpy host table;
* graph rows, now: `TableRows.write`.

Medians over `--steps` steps, in ms, and each "now" as a speedup over its "before".
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from cadence.engine.block_tables import EagerBlockTables, TableRows


def _padded_tensor(lists: list[list[int]]) -> torch.Tensor:
    width = max(len(ids) for ids in lists)
    return torch.tensor([ids + [0] * (width - len(ids)) for ids in lists], dtype=torch.long)


def _time_steps(lists: list[list[int]], steps: int, step: Callable[[list[int]], object]) -> float:
    """Median ms of `step(write_blocks)` over `steps` decode steps, growing the lists as
    decode would (one in 16 sequences starts a new block each step)."""
    next_block = 1 + max(max(ids) for ids in lists)
    times = []
    for s in range(steps):
        for i in range(s % 16, len(lists), 16):
            lists[i].append(next_block)
            next_block += 1
        write_blocks = [len(ids) - 1 for ids in lists]
        start = time.perf_counter()
        step(write_blocks)
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(batch: int, blocks: int, steps: int) -> dict[str, float]:
    lists = [list(range(i * blocks * 2, i * blocks * 2 + blocks)) for i in range(batch)]
    ids = [f"r{i}" for i in range(batch)]
    mirrors = EagerBlockTables()
    table = np.zeros((batch, blocks + steps), dtype=np.int32)
    rows = TableRows(table)

    def whole_rows(write_blocks: list[int]) -> None:
        for i, held in enumerate(lists):
            table[i, : len(held)] = held

    def table_rows(write_blocks: list[int]) -> None:
        for i, held in enumerate(lists):
            rows.write(i, held, write_blocks[i])

    def mirrored(write_blocks: list[int]) -> None:
        torch.from_numpy(mirrors.build(list(zip(ids, lists, write_blocks))))

    timed = {
        "eager before": lambda w: _padded_tensor(lists),
        "eager now": mirrored,
        "graph rows before": whole_rows,
        "graph rows now": table_rows,
    }
    results: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(3):  # alternate, so drift in the machine's load hits every variant alike
        for name, step in timed.items():
            results[name].append(_time_steps(lists, steps, step))
            reset_lists(lists, blocks)
    return {name: statistics.median(values) for name, values in results.items()}


def reset_lists(lists: list[list[int]], blocks: int) -> None:
    """Back to `blocks` blocks each (new list objects: every mirror refills once, as at
    admission), so each variant times the same sizes."""
    for i, held in enumerate(lists):
        lists[i] = held[:blocks]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--blocks", type=int, nargs="+", default=[8, 128, 512, 2048])
    parser.add_argument("--steps", type=int, default=32)
    args = parser.parse_args()
    print("| batch | blocks (tokens) | eager before | eager now | speedup | graph rows before | graph rows now | speedup |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in args.batch:
        for blocks in args.blocks:
            r = measure(batch, blocks, args.steps)
            print(f"| {batch} | {blocks} ({16 * blocks}) | {r['eager before']:.2f} | {r['eager now']:.2f} | "
                  f"{r['eager before'] / r['eager now']:.1f}x | {r['graph rows before']:.2f} | "
                  f"{r['graph rows now']:.2f} | {r['graph rows before'] / r['graph rows now']:.1f}x |")


if __name__ == "__main__":
    main()
