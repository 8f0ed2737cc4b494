"""Engine-level timings: each step's phases from `EngineCore.timings`, and batch-1 rates.

Phase times come from the engine's own `StepTimings` (schedule / execute / update), read
before and after every `EngineCore.step()` the bench drives itself; nothing in the engine
is wrapped. The LM head is timed apart, through the model's `compute_logits` on a hidden
state of one row, because inside a step it is part of `execute`.
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass

import torch

from cadence import LLM, SamplingParams
from cadence.engine.engine_core import EngineCore
from cadence.engine.protocol import EngineCoreRequest
from cadence.engine.step_stats import StepTimings
from common.timer import time_call

_request_ids = itertools.count()


@dataclass
class StepPhases:
    """Seconds one engine step spent in each phase (or medians over steps)."""

    schedule: float
    execute: float
    update: float

    @property
    def total(self) -> float:
        return self.schedule + self.execute + self.update


def phases_since(before: StepTimings, after: StepTimings) -> StepPhases:
    """What the engine's accumulated timings grew by between two snapshots."""
    return StepPhases(after.schedule - before.schedule, after.execute - before.execute, after.update - before.update)


def snapshot(timings: StepTimings) -> StepTimings:
    """A copy of the engine's running totals (the engine keeps adding to its own)."""
    return StepTimings(timings.schedule, timings.execute, timings.update, timings.num_steps)


def run_timed_steps(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> list[StepPhases]:
    """Add the prompts, step the engine until they finish, and return every step's phases."""
    for prompt in prompts:
        engine.add_request(EngineCoreRequest(f"bench-{next(_request_ids)}", list(prompt), params))
    steps = []
    while engine.has_unfinished_requests():
        before = snapshot(engine.timings)
        engine.step()
        steps.append(phases_since(before, engine.timings))
    return steps


def median_phases(steps: list[StepPhases]) -> StepPhases:
    """Per-phase medians: single steps on a shared machine jump by tens of percent."""
    return StepPhases(
        statistics.median(s.schedule for s in steps),
        statistics.median(s.execute for s in steps),
        statistics.median(s.update for s in steps),
    )


def decode_steps(llm: LLM, prompt: list[int], new_tokens: int) -> list[StepPhases]:
    """The batch-1 decode steps of one greedy generation (the first step, the prefill, dropped)."""
    params = SamplingParams(max_tokens=1 + new_tokens, temperature=0.0, ignore_eos=True)
    return run_timed_steps(llm.engine, [prompt], params)[1:]


def lm_head_ms(llm: LLM, rows: int = 1) -> float:
    """Median milliseconds of the model's `compute_logits` on `rows` hidden states."""
    engine = llm.engine
    hidden = torch.randn(rows, engine.model_config.hidden_size, dtype=engine.dtype, device=engine.device)
    sync = torch.cuda.synchronize if hidden.is_cuda else (lambda: None)

    def call() -> None:
        engine.model.compute_logits(hidden)
        sync()

    with torch.inference_mode():
        return time_call(call, 0.2) / 1e3


def decode_tokens_per_s(llm: LLM, prompt: list[int], new_tokens: int, repeats: int) -> float:
    """Batch-1 decode rate through `LLM.generate`: (time for 1 + new_tokens) - (time for 1 token), per token."""

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": prompt}], params)
        return time.perf_counter() - start

    run(4)  # warm-up: first calls allocate
    best = float("inf")
    for _ in range(repeats):
        best = min(best, run(1 + new_tokens) - run(1))
    return new_tokens / best


def prefill_tokens_per_s(llm: LLM, vocab_size: int, prompt_len: int, batch: int, repeats: int) -> float:
    """Prompt tokens per second for a batch of fresh random prompts (no prefix-cache hits)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms up
        prompts = [
            {"prompt_token_ids": torch.randint(3, vocab_size, (prompt_len,), generator=g).tolist()}
            for _ in range(batch)
        ]
        start = time.perf_counter()
        llm.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
    return batch * prompt_len / best
