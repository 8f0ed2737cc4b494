"""Cadence's side of the comparison: `LLM.generate` on a workload, with per-step records."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass

from cadence import LLM, SamplingParams
from machine import Contention
from step_probe import StepProbe
from workloads import Workload

OUT_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
BLOCK_SIZE = 16


@dataclass
class CadenceResult:
    max_num_batched_tokens: int
    seconds: float
    output_tokens: int
    token_ids: list[list[int]]
    records: list[dict[str, float]]  # StepProbe's, one per engine step
    engine_timings: dict[str, float]  # the engine's own StepTimings over this run
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


def run_cadence(llm: LLM, probe: StepProbe, work: Workload, mbt: int) -> CadenceResult:
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in work.max_tokens]
    # The engine's StepTimings accumulate over its life: take the difference over this run.
    t = llm.engine.timings
    before = (t.schedule, t.execute, t.update, t.num_steps)
    probe.reset()
    with Contention() as c:
        start = time.perf_counter()
        outs = llm.generate(work.prompts, params)
        seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    produced = sum(len(x) for x in token_ids)
    if produced != work.useful_tokens:
        print(f"WARNING: Cadence produced {produced} tokens, expected {work.useful_tokens}", flush=True)
    timings = dict(
        schedule=t.schedule - before[0],
        execute=t.execute - before[1],
        update=t.update - before[2],
        num_steps=t.num_steps - before[3],
    )
    return CadenceResult(mbt, seconds, produced, token_ids, list(probe.records), timings, c.other_cores)


def dump_steps(res: CadenceResult, label: str) -> None:
    """Per-step records to bench/out/steps-<label>-mbt<N>.json, for looking at afterwards."""
    os.makedirs(OUT_DIR, exist_ok=True)
    path = os.path.join(OUT_DIR, f"steps-{label}-mbt{res.max_num_batched_tokens}.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump([dict(r) for r in res.records], f)
