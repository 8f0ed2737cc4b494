"""What each CPU kernel's numerics cost the default model: perplexity and top-1 agreement.

    python bench/kernel_accuracy.py                          # dense, fp16, bf16dot, int8x2dot, int8dot, packed
    python bench/kernel_accuracy.py --kernels dense int8dot --tokens 512

The default model (its GGUF's own Q4_1 blocks, int8 LM head) is loaded once per kernel
with ``--cpu-kernels KERNEL``, so every projection runs that kernel at every batch size
(the LM head keeps a kernel that does not round its logits). On a fixed text (the
repository's README and docs/ARCHITECTURE.md, the first ``--tokens`` tokens, plus
tests/quant_eval.py's text) it prints each kernel's perplexity and how often its most
likely next token is the reference kernel's (``dense``: the dequantized weights in fp32,
the model's own values without further rounding). A kernel the planner does not run
where the script runs is left out of the table, with what ran instead.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Sequence
from typing import Any

from cadence import LLM, SamplingParams
from cadence.kernels.cpu.kernel_names import KERNELS
from common.from_tests import EVAL_TEXT
from common.machine import machine_info, machine_line

DEFAULT_KERNELS = ("dense", "fp16", "bf16dot", "int8x2dot", "int8dot", "packed")
ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def texts(tokenizer: Any, tokens: int) -> dict[str, list[int]]:
    docs = ""
    for name in ("README.md", os.path.join("docs", "ARCHITECTURE.md")):
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            docs += f.read() + "\n"
    return {"docs": tokenizer.encode(docs)[:tokens], "eval": tokenizer.encode(EVAL_TEXT)}


def scored(llm: LLM, ids: Sequence[int]) -> tuple[float, list[int]]:
    """(perplexity, the most likely token at every position after the first)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    out = llm.generate([{"prompt_token_ids": list(ids)}], params)[0]
    chosen: list[float] = []
    top: list[int] = []
    for position, logprobs in enumerate(out.prompt_logprobs[1:], start=1):
        chosen.append(logprobs[ids[position]].logprob)
        top.append(next(token for token, lp in logprobs.items() if lp.rank == 1))
    return math.exp(-sum(chosen) / len(chosen)), top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kernels", nargs="+", choices=KERNELS, default=list(DEFAULT_KERNELS))
    ap.add_argument("--tokens", type=int, default=1024, help="tokens of the docs text")
    args = ap.parse_args()
    print(machine_line(machine_info()))
    results: dict[str, dict[str, tuple[float, list[int]]]] = {}
    for kernel in args.kernels:
        llm = LLM(cpu_kernels=kernel, enable_prefix_caching=False)
        ran = {getattr(m, "cpu_kernel", None) for m in llm.engine.model.modules()} - {None}
        if kernel not in ran:
            print(f"{kernel}: not run here (the planner fell back to {sorted(ran)})")
            continue
        results[kernel] = {name: scored(llm, ids) for name, ids in texts(llm.get_tokenizer(), args.tokens).items()}
        del llm
    reference = results.get("dense")
    print("| kernel | " + " | ".join(f"{name} ppl | {name} top-1 = dense" for name in ("docs", "eval")) + " |")
    print("|---|---:|---:|---:|---:|")
    for kernel, by_text in results.items():
        cells = []
        for name, (ppl, top) in by_text.items():
            agree = (
                "-" if reference is None else f"{sum(a == b for a, b in zip(top, reference[name][1])) / len(top):.1%}"
            )
            cells += [f"{ppl:.3f}", agree]
        print(f"| {kernel} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
