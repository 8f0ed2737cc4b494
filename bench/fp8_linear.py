"""Which CPU path should serve an FP8 W8A8 linear layer: the data for Fp8Linear's CPU choice.

Times one ``y = x @ W.T`` per call at SmolLM2-135M's projection shapes and several M,
through the dense baselines and every torch path that can serve an fp8 e4m3 weight
with a per-channel scale. All fp8 paths quantize x per token inside the timed call.

* ``dense fp32`` / ``dense bf16``: F.linear on the unquantized weight (baselines; x is
  cast to bf16 inside the call when it is not bf16 already).
* ``Fp8Linear (CPU path)``: the module itself: fp8 codes decoded to fp16 with integer
  ops, the fp16 matmul, both scales on the output.
* ``_scaled_mm (oneDNN)``: ``torch._scaled_mm`` on the fp8 tensors, row-wise scales.
* ``fp8 .to(bf16) + bf16 mm``: both code tensors cast to bf16 by torch, then the AMX
  bf16 matmul and the scales: the same arithmetic, with torch's own fp8 cast.
* ``dequant W to bf16 + F.linear``: weight-only (x is not quantized), for comparison;
  not W8A8, so not what the GPU computes.

``--smollm2`` adds the model-level view: SmolLM2-135M dense vs ``--quantization fp8``
(fp32 and bf16): perplexity on tests/quant_eval.py's text and batch-1 decode tokens/s.

Each cell is the best of ``--rounds`` medians (see cpu_linear.time_call), so a
neighbour's burst on a shared machine inflates a round, not the table; the run also
reports how many cores other processes used meanwhile.

    python bench/fp8_linear.py                         # fp32 activations, M = 1 16 64 256
    python bench/fp8_linear.py --act-dtype bfloat16    # bf16 activations
    python bench/fp8_linear.py --smollm2               # and the SmolLM2 table
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cadence import LLM, SamplingParams
from cadence.engine.quantization.fp8_linear import Fp8Linear
from cadence.kernels.fp8_format import quantize_fp8_per_token
from cpu_linear import cpu_flags, time_call
from machine import Contention, machine_info

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from quant_eval import EVAL_TEXT, perplexity  # noqa: E402

SMOLLM2_SHAPES = ((576, 1536), (576, 576), (1536, 576))  # (K, N): up-projection, o_proj, down_proj


def build_paths(k: int, n: int, m: int, act_dtype: torch.dtype) -> dict[str, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False).requires_grad_(False)
    nn.init.normal_(linear.weight, std=k**-0.5)
    fp8 = Fp8Linear.from_linear(linear)
    wq, w_scale = fp8.qweight, fp8.weight_scale
    x = torch.randn(m, k).to(act_dtype)
    w_bf16, w32 = linear.weight.bfloat16(), linear.weight.float()

    def scaled_mm() -> torch.Tensor:
        xq, x_scale = quantize_fp8_per_token(x)
        return torch._scaled_mm(xq, wq.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=act_dtype)

    def torch_cast_codes() -> torch.Tensor:
        xq, x_scale = quantize_fp8_per_token(x)
        y = F.linear(xq.to(torch.bfloat16), wq.to(torch.bfloat16))
        return (y.float() * x_scale[:, None] * w_scale).to(act_dtype)

    def dequant_weight() -> torch.Tensor:
        w = wq.to(torch.bfloat16) * w_scale.to(torch.bfloat16)[:, None]
        return F.linear(x.to(torch.bfloat16), w).to(act_dtype)

    return {
        "dense fp32": lambda: F.linear(x.float(), w32),
        "dense bf16": lambda: F.linear(x.to(torch.bfloat16), w_bf16),
        "Fp8Linear (CPU path)": lambda: fp8(x),
        "_scaled_mm (oneDNN)": scaled_mm,
        "fp8 .to(bf16) + bf16 mm": torch_cast_codes,
        "dequant W to bf16 + F.linear": dequant_weight,
        "(per-token quantize of x alone)": lambda: quantize_fp8_per_token(x)[0],
    }


def decode_tokens_per_second(llm: LLM, new_tokens: int = 32, repeats: int = 3) -> float:
    """Batch-1 greedy decode speed: (time of 1 + N tokens - time of 1 token) / N, best of repeats."""
    prompt = [{"prompt_token_ids": [1, 504, 3458, 314, 260]}]

    def seconds(max_tokens: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return time.perf_counter() - start

    best = min(seconds(1 + new_tokens) - seconds(1) for _ in range(repeats))
    return new_tokens / best


def smollm2_table() -> None:
    from cadence.engine.default_model import resolve_model_path

    path = resolve_model_path(None)
    print("\nSmolLM2-135M-Instruct, dense vs --quantization fp8\n")
    print("| weights | model dtype | perplexity | vs dense fp32 | decode tok/s (batch 1) |")
    print("|---|---|---:|---:|---:|")
    dense_ppl = None
    for quantization, dtype in ((None, "float32"), ("fp8", "float32"), (None, "bfloat16"), ("fp8", "bfloat16")):
        llm = LLM(path, dtype=dtype, quantization=quantization, max_model_len=1024, num_gpu_blocks=128)
        tokenizer = llm.get_tokenizer()
        assert tokenizer is not None
        ppl = perplexity(llm, tokenizer(EVAL_TEXT)["input_ids"])
        dense_ppl = dense_ppl or ppl
        print(f"| {quantization or 'dense'} | {dtype} | {ppl:.3f} | {100 * (ppl / dense_ppl - 1):+.2f}% "
              f"| {decode_tokens_per_second(llm):.1f} |")
        del llm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256], help="batch rows")
    ap.add_argument("--act-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="the activations' dtype (the model's dtype)")
    ap.add_argument("--rounds", type=int, default=3, help="repeat every measurement; keep the best median")
    ap.add_argument("--smollm2", action="store_true", help="also the SmolLM2 perplexity and decode table")
    args = ap.parse_args(argv)
    act_dtype = getattr(torch, args.act_dtype)
    info = machine_info()
    print(f"# FP8 W8A8 linear paths on CPU, {args.act_dtype} activations ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"cpu: {info['cpu']}, {info['cores']} cores, threads {info['threads']}, torch {info['torch']}")
    print(f"ISA: {', '.join(cpu_flags()) or 'none of the checked extensions'}")
    for k, n in SMOLLM2_SHAPES:
        results: dict[str, dict[int, float]] = {}
        with Contention() as contention:
            for _ in range(args.rounds):
                for m in args.m:
                    for name, fn in build_paths(k, n, m, act_dtype).items():
                        best = results.setdefault(name, {}).get(m, float("inf"))
                        results[name][m] = min(best, time_call(fn))
        print(f"\n{k} -> {n}: µs per call, best of {args.rounds} medians (x the dense bf16 time); "
              f"other processes used {contention.other_cores:.2f} cores meanwhile\n")
        print("| path | " + " | ".join(f"M={m}" for m in args.m) + " |")
        print("|---|" + "---:|" * len(args.m))
        base = results["dense bf16"]
        for name, by_m in results.items():
            cells = [f"{by_m[m]:,.0f} ({by_m[m] / base[m]:.2f}x)" for m in args.m]
            print(f"| {name} | " + " | ".join(cells) + " |")
    if args.smollm2:
        smollm2_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
