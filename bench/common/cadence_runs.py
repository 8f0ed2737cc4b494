"""Cadence's side of the comparison: `LLM.generate` on a workload, with the engine's own step timings."""

from __future__ import annotations

import time
from dataclasses import dataclass

from cadence import LLM, SamplingParams
from common.engine_timing import StepPhases, phases_since, snapshot
from common.machine import Contention
from common.workloads import Workload

BLOCK_SIZE = 16


@dataclass
class CadenceResult:
    max_num_batched_tokens: int
    seconds: float
    output_tokens: int
    token_ids: list[list[int]]
    phases: StepPhases  # seconds in each phase, summed over the run's steps (the engine's StepTimings)
    num_steps: int
    other_cores: float = 0.0

    @property
    def tok_per_s(self) -> float:
        return self.output_tokens / self.seconds


def blocks_needed(work: Workload) -> int:
    """Enough KV blocks for every sequence at once at full length, plus slack."""
    return sum(-(-(len(p) + m) // BLOCK_SIZE) for p, m in zip(work.prompts, work.max_tokens)) + 64


def max_model_len_for(work: Workload) -> int:
    """The longest sequence the workload makes, plus slack."""
    return max(len(p) + m for p, m in zip(work.prompts, work.max_tokens)) + 16


def cadence_llm(path: str, work_blocks: int, max_num_batched_tokens: int, max_model_len: int, dtype: str) -> LLM:
    return LLM(
        model=path,
        dtype=dtype,
        max_num_seqs=256,
        max_num_batched_tokens=max_num_batched_tokens,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        num_gpu_blocks=work_blocks,
        max_model_len=max_model_len,
    )


def warm_up(llm: LLM) -> None:
    """A tiny generate first, so one-time costs do not land in the timed run."""
    llm.generate([[1, 2, 3, 4, 5, 6, 7, 8]] * 2, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def run_cadence(llm: LLM, work: Workload, mbt: int) -> CadenceResult:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in work.max_tokens]
    # The engine's StepTimings accumulate over its life: take the difference over this run.
    before = snapshot(llm.engine.timings)
    with Contention() as c:
        start = time.perf_counter()
        outs = llm.generate(work.prompts, params)
        seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    produced = sum(len(x) for x in token_ids)
    if produced != work.useful_tokens:
        print(f"WARNING: Cadence produced {produced} tokens, expected {work.useful_tokens}", flush=True)
    after = llm.engine.timings
    phases = phases_since(before, after)
    return CadenceResult(mbt, seconds, produced, token_ids, phases, after.num_steps - before.num_steps, c.other_cores)
