"""Where a full-batch decode step spends its time, from StepProbe's records, as a markdown table."""
from __future__ import annotations

import statistics


def breakdown(records: list[dict[str, float]], batch: int) -> tuple[int, dict[str, float]] | None:
    """Mean seconds per phase over pure-decode steps with `batch` sequences."""
    steps = [r for r in records if r.get("num_decodes") == batch and r.get("num_tokens") == batch]
    # The last step's outproc is not seen (no next step); skip steps without it.
    steps = [r for r in steps if "outproc" in r]
    if not steps:
        return None
    mean: dict[str, float] = {}
    for key in ("schedule", "execute", "forward", "logits", "sample", "update", "outproc", "step"):
        mean[key] = statistics.fmean(r.get(key, 0.0) for r in steps)
    mean["prep"] = mean["execute"] - mean["forward"] - mean["logits"] - mean["sample"]
    return len(steps), mean


def overhead_lines(n_steps: int, m: dict[str, float], batch: int) -> list[str]:
    """The per-phase table and the overhead share: everything but model compute, over step time."""
    step = m["step"]
    loop = step + m["outproc"]
    overhead = m["schedule"] + m["prep"] + m["sample"] + m["update"]
    lines = [
        f"Per-step breakdown, mean of {n_steps} pure-decode steps at batch {batch}:",
        "",
        "| phase | ms/step | share of engine step |",
        "|---|---:|---:|",
    ]
    names = {
        "schedule": "schedule (scheduler.schedule)",
        "prep": "input prep (execute minus forward/logits/sample: token/position/slot tensors, attention metadata)",
        "forward": "model forward (all layers incl. paged attention)",
        "logits": "compute_logits (lm_head GEMM, model compute)",
        "sample": "sampling (_sample: metadata, sampler, tolist)",
        "update": "update (scheduler.update + outputs)",
    }
    for key, label in names.items():
        lines.append(f"| {label} | {m[key] * 1e3:.2f} | {m[key] / step * 100:.1f}% |")
    lines.append(f"| **engine step total** | {step * 1e3:.2f} | 100% |")
    lines.append(
        f"| LLM.generate output processing between steps (not in engine step) | {m['outproc'] * 1e3:.2f} | "
        f"({m['outproc'] / loop * 100:.1f}% of loop iteration) |"
    )
    lines += [
        "",
        f"**Per-step overhead at batch {batch}** = (schedule + input prep + sampling + update) / step time "
        f"= {overhead * 1e3:.2f} / {step * 1e3:.2f} ms = **{overhead / step * 100:.1f}%** "
        f"(counting LLM.generate's output processing too: {(overhead + m['outproc']) / loop * 100:.1f}%).",
    ]
    return lines
