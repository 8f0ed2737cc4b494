"""The runner's block tables, built from step deltas alone, against the scheduler's own.

`InputBatch` keeps a row per request, updated only from each `SchedulerOutput` (sent
through msgpack, as to another process). The real scheduler under random traffic, with
its steps split between eager tables and the decode graphs' static rows, checks every
table, slot and input token against the requests themselves.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from cadence.engine.attention.backend import AttentionBackend, AttentionSpec
from cadence.engine.cuda_graphs import DecodeGraphs
from cadence.engine.forward_context import ForwardContext
from cadence.engine.input_batch import InputBatch, StepInputs
from cadence.engine.model_config import ModelConfig
from cadence.engine.protocol import decode, encode
from cadence.scheduler.output import CachedRequestData, NewRequestData, SchedulerOutput
from cadence.scheduler.request import Request, StopConditions
from cadence.scheduler.scheduler import CacheConfig, Scheduler, SchedulerConfig

BLOCK_SIZE = 4


def new_request(request_id: str, tokens: list[int], blocks: list[int], computed: int = 0) -> NewRequestData:
    return NewRequestData(request_id, tokens, len(tokens), None, [0], blocks, computed)


def delta(
    request_id: str, tokens: list[int], blocks: list[int], computed: int, replaced: list[tuple[int, int]] | None = None
) -> CachedRequestData:
    return CachedRequestData(request_id, tokens, blocks, replaced or [], computed)


def test_rows_follow_appends_swaps_and_reuse() -> None:
    batch = InputBatch(max_num_seqs=2, max_model_len=32, block_size=BLOCK_SIZE)
    batch.apply(
        SchedulerOutput(new_requests=[new_request("a", list(range(1, 11)), [5, 6, 7])], num_scheduled_tokens={"a": 10})
    )
    step = batch.prepare({"a": 10})
    assert batch.step_block_table(step).tolist() == [[5, 6, 7]]
    assert step.input_ids.tolist() == list(range(1, 11)) and step.positions.tolist() == list(range(10))
    assert step.slot_mapping.tolist() == [5 * 4, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    # A forked sibling shares block 7; the parent's copy-on-write swaps it for 9 in place.
    batch.apply(SchedulerOutput(cached_requests=[delta("a", [50], [], 10, [(2, 9)])], num_scheduled_tokens={"a": 1}))
    step = batch.prepare({"a": 1})
    assert batch.step_block_table(step).tolist() == [[5, 6, 9]]
    assert step.input_ids.tolist() == [50] and step.slot_mapping.tolist() == [9 * 4 + 2]
    # "b" takes the other row; when "a" goes, its row is cleared before "c" reuses it.
    batch.apply(SchedulerOutput(new_requests=[new_request("b", [3], [1])], num_scheduled_tokens={"b": 1}))
    batch.apply(
        SchedulerOutput(
            new_requests=[new_request("c", [4, 4], [2])],
            cached_requests=[delta("b", [8], [], 1)],
            num_scheduled_tokens={"c": 2, "b": 1},
            finished_request_ids=["a"],
        )
    )
    step = batch.prepare({"c": 2, "b": 1})
    assert [s.request_id for s in step.requests] == ["b", "c"]  # the decode first
    assert batch.step_block_table(step).tolist() == [[1], [2]]
    assert batch.block_table[batch.requests["c"].row].tolist() == [2] + [0] * 7
    assert step.query_starts == [0, 1] and step.positions.tolist() == [1, 0, 1]
    assert step.input_ids.tolist() == [8, 4, 4] and step.samples(0) and step.samples(1)
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        batch.add(new_request("d", [1], [3]))


class _GraphHooks(AttentionBackend):
    """Just enough of a backend for DecodeGraphs to stage its host rows (no forward runs)."""

    supports_cuda_graphs = True

    def build_metadata(self, batch: Any) -> Any:
        raise AssertionError("no forward in this test")

    def forward(self, *args: Any) -> Any:
        raise AssertionError("no forward in this test")


class _NoForwardModel(nn.Module):
    """Just enough of a ``CausalLM`` for DecodeGraphs to hold (without graphs, it never calls it)."""

    config: ModelConfig  # never read
    batch_invariant = False

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        raise AssertionError("no forward in this test")

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        raise AssertionError("no forward in this test")

    def attention_spec(self) -> AttentionSpec:
        raise AssertionError("DecodeGraphs is given its backend's spec")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        raise AssertionError("no weights in this test")


class _Walk:
    """The real Scheduler and KVCacheManager under random traffic: shared prefixes (prefix
    cache hits), n > 1 forks, aborts, a pool small enough to preempt, reused request ids and
    token budgets down to 3 (one-token prompt chunks). The runner side sees only the
    msgpacked outputs. Each step goes, as in ``ModelRunner.execute``, to the graph rows
    (only when every row decodes one token, and then at random) or to an eager table, and
    every table is checked against the scheduler's lists."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=self.rng.choice([3, 8, 20]), max_model_len=160)
        self.scheduler = Scheduler(config, CacheConfig(num_blocks=60, block_size=BLOCK_SIZE))
        self.prefixes = [[self.rng.randrange(1, 50) for _ in range(self.rng.randrange(1, 30))] for _ in range(3)]
        self.batch = InputBatch(max_num_seqs=6, max_model_len=160, block_size=BLOCK_SIZE)
        self.graphs = DecodeGraphs(
            _NoForwardModel(),
            _GraphHooks(AttentionSpec(2, 1, 8, 0.5), BLOCK_SIZE),
            [],
            max_batch=8,
            max_model_len=160,
            block_size=BLOCK_SIZE,
            device=torch.device("cpu"),
            use_graphs=False,
        )
        self.graphs.host_tables.fill(-1)  # nothing a step needs may be left from here
        self.arrivals = 0
        self.steps = {"eager": 0, "graph": 0}

    def _add(self, request_id: str, prompt: list[int], parent: str | None) -> None:
        self.arrivals += 1
        stop = StopConditions(max_tokens=self.rng.randrange(1, 60), stop_token_ids=frozenset({0}))
        self.scheduler.add_request(
            Request(
                request_id, list(prompt), stop, self.arrivals, priority=self.rng.randrange(2), fork_parent_id=parent
            )
        )

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

    def _check_inputs(self, step: StepInputs) -> list[list[int]]:
        """Every flat token, position and slot against the scheduler; returns the block lists."""
        held_lists = []
        for i, state in enumerate(step.requests):
            request = self.scheduler.requests[state.request_id]
            start, count, flat = step.context_lens[i], step.query_lens[i], step.query_starts[i]
            assert start == request.num_computed_tokens
            positions = list(range(start, start + count))
            assert step.positions[flat : flat + count].tolist() == positions
            assert step.input_ids[flat : flat + count].tolist() == request.token_ids[start : start + count]
            held = request.block_ids
            slots = [held[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in positions]
            assert step.slot_mapping[flat : flat + count].tolist() == slots
            assert step.samples(i) == (start + count == request.num_tokens)
            held_lists.append(held)
        return held_lists

    def step(self) -> None:
        rng, scheduler = self.rng, self.scheduler
        if len(scheduler.requests) < 8 and rng.random() < 0.4:
            self._arrive()
        if scheduler.requests and rng.random() < 0.03:
            scheduler.abort_requests([rng.choice(list(scheduler.requests))])
        output = scheduler.schedule()
        wire = decode(encode(output))
        assert isinstance(wire, SchedulerOutput)
        self.batch.apply(wire)
        assert set(self.batch.requests) == {r.request_id for r in scheduler.running}
        if wire.num_scheduled_tokens:
            step = self.batch.prepare(wire.num_scheduled_tokens)
            held_lists = self._check_inputs(step)
            if self.graphs.can_run(step) and rng.random() < 0.6:
                padded = self.graphs.stage(step, self.batch.block_table)
                for i, held in enumerate(held_lists):
                    assert self.graphs.host_tables[i, : len(held)].tolist() == held
                assert not self.graphs.host_tables[len(held_lists) : padded, 0].any()  # padding reads block 0
                self.steps["graph"] += 1
            else:
                table = self.batch.step_block_table(step)
                assert table.dtype == np.int32 and table.shape == (step.num_seqs, max(map(len, held_lists)))
                for i, held in enumerate(held_lists):
                    assert table[i, : len(held)].tolist() == held and not table[i, len(held) :].any()
                self.steps["eager"] += 1
        sampled = {
            rid: rng.randrange(50)
            for rid in output.num_scheduled_tokens
            if scheduler.requests[rid].num_computed_tokens + output.num_scheduled_tokens[rid]
            == scheduler.requests[rid].num_tokens
        }
        scheduler.update(output, sampled)


def test_runner_tables_match_the_scheduler_under_random_traffic() -> None:
    steps = {"eager": 0, "graph": 0}
    for seed in range(30):
        walk = _Walk(seed)
        for _ in range(400):
            walk.step()
        for path, count in walk.steps.items():
            steps[path] += count
    assert min(steps.values()) > 1000  # both paths, interleaved, many times
