"""torch.profiler and cProfile tables of Cadence's decode steps at full batch (--profile)."""

from __future__ import annotations

import cProfile
import gc
import io
import pstats

from torch.profiler import ProfilerActivity, profile, record_function

from cadence import SamplingParams
from cadence.engine.engine_core import EngineCore
from cadence.engine.protocol import EngineCoreRequest
from common.cadence_runs import blocks_needed, cadence_llm, max_model_len_for
from common.workloads import Workload


def step_until_decoding(engine: EngineCore, batch: int) -> None:
    """Step until all ``batch`` requests added are decoding, then a few more steps: the first
    decode steps of a batch size may still allocate, or compile kernels on a GPU."""
    for _ in range(1000):
        engine.step()
        running = engine.scheduler.running
        if len(running) == batch and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running):
            break
    for _ in range(3):
        engine.step()


def profile_decode(path: str, work: Workload, mbt: int, dtype: str, num_steps: int = 10) -> list[str]:
    """torch.profiler and cProfile over `num_steps` pure-decode steps at full batch."""
    llm = cadence_llm(path, blocks_needed(work), mbt, max_model_len_for(work), dtype)
    engine = llm.engine
    # Driven through the engine, not LLM.generate, so the profiles hold engine steps only.
    for i, p in enumerate(work.prompts):
        # Room for the steps before and during both profiles, so no sequence finishes early.
        params = SamplingParams(max_tokens=max(work.max_tokens) + 3 * num_steps, temperature=0.0, ignore_eos=True)
        engine.add_request(EngineCoreRequest(f"prof-{i}", p, params, 0))
    batch = len(work.prompts)
    step_until_decoding(engine, batch)

    out: list[str] = []
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            with record_function("engine.step"):
                engine.step()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=60)
    out += [
        f"### torch.profiler: {num_steps} decode steps at batch {batch} (sorted by self CPU time)",
        "",
        "```",
        table,
        "```",
        "",
    ]

    pr = cProfile.Profile()
    pr.enable()
    for _ in range(num_steps):
        engine.step()
    pr.disable()
    buf = io.StringIO()
    stats = pstats.Stats(pr, stream=buf)
    stats.sort_stats("tottime").print_stats(30)
    out += [
        f"### cProfile: {num_steps} decode steps at batch {batch} (sorted by tottime)",
        "",
        "```",
        buf.getvalue().strip(),
        "```",
        "",
    ]
    engine.abort_requests([f"prof-{i}" for i in range(batch)])
    del llm, engine
    gc.collect()
    return out
