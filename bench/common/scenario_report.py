"""The markdown a scenario contributes to the report: a summary-table row and a details section."""

from __future__ import annotations

from common.cadence_runs import CadenceResult
from common.hf_baseline import HFResult
from common.workloads import Workload

TABLE_HEADER = [
    "| scenario | prompts | useful output tokens | transformers tok/s (time) | Cadence tok/s (time) "
    "| Cadence / transformers | Cadence max_num_batched_tokens (tok/s each) |",
    "|---|---:|---:|---:|---:|---:|---|",
]


def scenario_row(work: Workload, hf: HFResult | None, results: list[CadenceResult], best: CadenceResult) -> str:
    hf_cell = f"{hf.tok_per_s:.1f}" if hf else "skipped"
    ratio = f"{best.tok_per_s / hf.tok_per_s:.2f}x" if hf else "-"
    hf_time = f"{hf.seconds:.1f}" if hf else "-"
    tried = ", ".join(f"{r.max_num_batched_tokens}: {r.tok_per_s:.1f}" for r in results)
    return (
        f"| {work.name} | {len(work.prompts)} | {work.useful_tokens} | {hf_cell} ({hf_time} s) | "
        f"{best.tok_per_s:.1f} ({best.seconds:.1f} s) | {ratio} | {best.max_num_batched_tokens} ({tried}) |"
    )


def scenario_details(
    work: Workload, hf: HFResult | None, results: list[CadenceResult], best: CadenceResult
) -> list[str]:
    details = [f"### Scenario `{work.name}`: {work.description}", ""]
    if hf:
        details.append(
            f"- transformers: one static batch of {len(work.prompts)}, left-padded, max_new_tokens = "
            f"min_new_tokens = {max(work.max_tokens)}; produced {hf.generated_tokens} tokens, of which "
            f"{hf.useful_tokens} were asked for (only those count)"
            + (
                ": a static batch cannot stop a row at its own max_tokens, so "
                f"{hf.generated_tokens - hf.useful_tokens} tokens are wasted; continuous batching removes exactly this."
                if hf.generated_tokens != hf.useful_tokens
                else "."
            )
        )
    details += step_lines(best)
    details.append(
        "- cores used by other processes during the timed runs (should be ~0): "
        + (f"transformers {hf.other_cores:.2f}, " if hf else "")
        + ", ".join(f"Cadence mbt={r.max_num_batched_tokens} {r.other_cores:.2f}" for r in results)
    )
    if hf:
        details.append(
            "- greedy spot-check vs transformers (random weights give near-flat logits, so a near-tie can "
            "flip a token and the continuations then diverge): " + "; ".join(_spot_check(work, hf, best))
        )
    details.append("")
    return details


def _first_mismatch(a: list[int], b: list[int]) -> int:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def _spot_check(work: Workload, hf: HFResult, best: CadenceResult) -> list[str]:
    """How far the first two prompts' greedy outputs agree between the engines."""
    matches = []
    for i in range(min(2, len(work.prompts))):
        a, b = best.token_ids[i], hf.token_ids[i]
        same = sum(x == y for x, y in zip(a, b))
        diff = _first_mismatch(a, b)
        where = "identical" if a == b else f"first difference at token {diff}"
        matches.append(f"prompt {i}: {same}/{len(b)} tokens equal ({where})")
    return matches


def step_lines(res: CadenceResult) -> list[str]:
    """Where the run's time went, from the engine's StepTimings: per-step means and the host share.

    `execute` is the model runner (inputs, forward, LM head, sampling); schedule, update and
    what LLM.generate does between steps (output processing) are the host's overhead.
    """
    p, steps = res.phases, max(res.num_steps, 1)
    outside = max(res.seconds - p.total, 0.0)
    overhead = p.schedule + p.update + outside
    return [
        f"- Cadence best at max_num_batched_tokens={res.max_num_batched_tokens}: {res.num_steps} engine steps, "
        f"per step schedule {p.schedule / steps * 1e3:.2f} ms, execute {p.execute / steps * 1e3:.2f} ms, "
        f"update {p.update / steps * 1e3:.2f} ms; outside the steps (LLM.generate's own work) "
        f"{outside / steps * 1e3:.2f} ms",
        f"- host overhead (schedule + update + outside the steps) / wall time = {overhead:.3f} / "
        f"{res.seconds:.2f} s = **{100 * overhead / res.seconds:.1f}%**",
    ]
