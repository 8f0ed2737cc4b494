"""Two engine configurations at batch-1 decode, interleaved in one process.

    python bench/decode_ab.py                                  # dense vs int8 LM head (gguf body)
    python bench/decode_ab.py --a dtype=float32 --b dtype=bfloat16
    python bench/decode_ab.py --base quantization=none                     # LM heads on a dense body

``--base`` holds the options both engines share (default: the default model's own
``quantization=gguf``); ``--a`` and ``--b`` what differs. Values are EngineArgs fields as
``name=value`` (true/false/none, numbers, or text). Both engines live in one process and
take turns, so the shared machine's load drifts over both alike, where bench/quant.py's
rows run one after another and cannot show a few ms. Each turn decodes one greedy
sequence by stepping the engine and reads every step's phases from the engine's own
StepTimings; it then times the LM head alone (the model's compute_logits on one row).
Prints the median engine step and its execute phase, the LM head, the step-bound tok/s,
and B's ratio over A.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from cadence import LLM
from cadence.engine.default_model import resolve_model_path
from common.engine_timing import StepPhases, decode_steps, lm_head_ms, median_phases
from common.from_tests import EVAL_TEXT


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["dtype=bfloat16", "quantize_lm_head=true"]`` -> EngineArgs keyword arguments."""
    words = {"true": True, "false": False, "none": None}
    options: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep:
            raise SystemExit(f"expected name=value, got {item!r}")
        value: Any = words.get(text.lower(), text)
        if isinstance(value, str):
            try:
                value = int(text)
            except ValueError:
                try:
                    value = float(text)
                except ValueError:
                    pass
        options[name] = value
    return options


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--base", nargs="*", default=["quantization=gguf"], help="options both engines take")
    ap.add_argument("--a", nargs="*", default=["quantize_lm_head=false"], help="engine A's own options")
    ap.add_argument("--b", nargs="*", default=["quantize_lm_head=true"], help="engine B's own options")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)
    path = resolve_model_path(args.model)
    base = {"max_model_len": 1024, "num_gpu_blocks": 128, **parse_options(args.base)}
    configs = {"A": args.a, "B": args.b}
    engines = {label: LLM(path, **{**base, **parse_options(items)}) for label, items in configs.items()}
    tokenizer = engines["A"].get_tokenizer()
    assert tokenizer is not None
    prompt = tokenizer(EVAL_TEXT)["input_ids"][:32]
    steps: dict[str, list[StepPhases]] = {label: [] for label in engines}
    heads: dict[str, list[float]] = {label: [] for label in engines}
    for llm in engines.values():
        decode_steps(llm, prompt, 4)  # warm-up: first steps allocate
    for _ in range(args.rounds):
        for label, llm in engines.items():
            steps[label] += decode_steps(llm, prompt, args.new_tokens)
            heads[label].append(lm_head_ms(llm))
    print(
        f"# Batch-1 decode A/B ({time.strftime('%Y-%m-%d %H:%M')}), {os.path.basename(path)}, "
        f"{' '.join(args.base)}; {args.rounds} x {args.new_tokens} tokens each, load {os.getloadavg()[0]:.2f}\n"
    )
    print("| engine | options | step ms | execute ms | LM head ms | step-bound tok/s |")
    print("|---|---|---:|---:|---:|---:|")
    bound = {}
    for label in engines:
        median = median_phases(steps[label])
        bound[label] = 1 / median.total
        print(
            f"| {label} | {' '.join(configs[label])} | {median.total * 1e3:.1f} | {median.execute * 1e3:.1f} "
            f"| {statistics.median(heads[label]):.2f} | {bound[label]:.1f} |"
        )
    print(f"\nB / A: {bound['B'] / bound['A']:.2f}x step-bound decode")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
