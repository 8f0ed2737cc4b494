"""Weight-only quantization on CPU: memory footprint and batch-1 decode speed on SmolLM2.

    python bench/quant.py                  # footprint + decode tok/s + int8 CPU crossover
    python bench/quant.py --skip-linear    # without the per-layer int8 crossover table

Three tables:
1. bytes held by the decoder's linear layers (the ones quantize_model swaps) and by the
   whole model, dense vs int8 vs int4 vs the GGUF's own blocks (``--quantization gguf``),
   each with a dense LM head and some with an int8 one (``--quantize-lm-head``);
2. decode tokens/s at batch 1 (one greedy sequence, EOS ignored): the time of a
   1 + N token generation minus a 1-token one, over N, best of a few repeats; the median
   model forward and LM head milliseconds of those steps (bench/step_probe.py); and
   prefill tokens/s for 4 fresh random 256-token prompts at once (best of the repeats);
3. Int8Linear's two CPU paths (packed op vs per-call dequantize + dense matmul) on
   SmolLM2's four projection shapes by M: where cpu_policy's int8_packed_max_m comes from.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from cpu_linear import time_call  # noqa: E402
from machine import machine_info  # noqa: E402
from quant_eval import EVAL_TEXT  # noqa: E402
from step_probe import StepProbe  # noqa: E402

from cadence import LLM, SamplingParams  # noqa: E402
from cadence.engine.default_model import resolve_model_path  # noqa: E402
from cadence.engine.quantization import TARGET_LAYERS, Int4Linear, Int8Linear  # noqa: E402
from cadence.engine.quantization.cpu_policy import cpu_policy  # noqa: E402

MiB = 1 << 20
# (quantization, model dtype, int8 LM head): each body with a dense head, then the
# int8-head rows (--quantize-lm-head; the gguf default when the file's head is Q8_0).
ROWS = [(None, "float32", False), (None, "bfloat16", False), ("int8", "float32", False), ("int4", "float32", False),
        ("int8", "bfloat16", False), ("int4", "bfloat16", False), ("gguf", "float32", False),
        (None, "float32", True), ("int8", "float32", True), ("int4", "bfloat16", True), ("gguf", "float32", True)]


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's own parameters and buffers (not its children's)."""
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    return sum(t.numel() * t.element_size() for t in tensors)


def footprint(model: nn.Module) -> tuple[int, int]:
    """(bytes in the swappable projections, bytes in the whole model)."""
    linear = sum(
        module_bytes(m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in TARGET_LAYERS
    )
    total = sum(module_bytes(m) for m in model.modules())
    return linear, total


def decode_tokens_per_s(llm: LLM, prompt: list[int], new_tokens: int, repeats: int) -> float:
    """Batch-1 decode rate: (time for 1 + new_tokens) - (time for 1 token), per token."""

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


def decode_phase_ms(probe: StepProbe) -> tuple[float, float]:
    """Median (model forward, LM head) milliseconds over the batch-1 decode steps seen:
    medians, because single steps on this shared machine jump by tens of percent."""
    steps = [r for r in probe.records if r.get("num_decodes") == 1 and r.get("num_tokens") == 1]
    return (statistics.median(r["forward"] for r in steps) * 1e3, statistics.median(r["logits"] for r in steps) * 1e3)


def prefill_tokens_per_s(llm: LLM, vocab_size: int, prompt_len: int, batch: int, repeats: int) -> float:
    """Prompt tokens per second for a batch of fresh random prompts (no prefix-cache hits)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    best = float("inf")
    for _ in range(repeats + 1):  # the first round warms up
        prompts = [{"prompt_token_ids": torch.randint(3, vocab_size, (prompt_len,), generator=g).tolist()}
                   for _ in range(batch)]
        start = time.perf_counter()
        llm.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
    return batch * prompt_len / best


def linear_crossover(ms: list[int]) -> None:
    """Int8Linear's packed vs dequantized CPU path by M on SmolLM2's projection shapes."""
    shapes = {"qkv 576->960": (960, 576), "o 576->576": (576, 576),
              "gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536)}
    print("\n| int8 CPU path, µs | " + " | ".join(f"M={m}" for m in ms) + " |")
    print("|---|" + "---|" * len(ms))
    for label, (n, k) in shapes.items():
        mod = Int8Linear.from_linear(nn.Linear(k, n, bias=False).requires_grad_(False))
        packed, dequant = [], []
        for m in ms:
            x = torch.randn(m, k)
            xb = x.to(torch.bfloat16)
            packed.append(time_call(lambda: torch.ops.aten._weight_int8pack_mm(xb, mod.qweight, mod.scale_bf16)))
            dequant.append(time_call(
                lambda: nn.functional.linear(xb, mod.qweight.to(torch.bfloat16) * mod.scale_bf16[:, None])))
        print(f"| {label} packed | " + " | ".join(f"{t:,.0f}" for t in packed) + " |")
        print(f"| {label} dequant+bf16 | " + " | ".join(f"{t:,.0f}" for t in dequant) + " |")
    print(f"\ncpu_policy(): {cpu_policy()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--skip-linear", action="store_true")
    args = ap.parse_args(argv)
    path = resolve_model_path(args.model)
    info = machine_info()
    print(f"# Quantized decode on CPU ({time.strftime('%Y-%m-%d %H:%M')}), {os.path.basename(path)}")
    print(f"cpu: {info['cpu']}, {info['cores']} cores, threads {info['threads']}, torch {info['torch']}, "
          f"load average {os.getloadavg()[0]:.2f}\n")
    print("| weights | LM head | model dtype | linear MiB | model MiB | decode tok/s (batch 1) | forward ms "
          "| head ms | prefill tok/s (4 x 256) | int4 group sizes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    # "gguf" serves the file's own Q4_1 blocks; it needs a model converted from a GGUF.
    has_gguf = os.path.isfile(os.path.join(path, "gguf_source.json"))
    for method, dtype, int8_head in ROWS:
        if method == "gguf" and not has_gguf:
            continue
        llm = LLM(path, dtype=dtype, quantization=method, quantize_lm_head=int8_head, max_model_len=1024,
                  num_gpu_blocks=128)
        tokenizer = llm.get_tokenizer()
        assert tokenizer is not None
        prompt = tokenizer(EVAL_TEXT)["input_ids"][:32]
        linear, total = footprint(llm.engine.model)
        groups = sorted({m.group_size for m in llm.engine.model.modules() if isinstance(m, Int4Linear)})
        probe = StepProbe(llm)
        rate = decode_tokens_per_s(llm, prompt, args.new_tokens, args.repeats)
        forward_ms, head_ms = decode_phase_ms(probe)
        prefill = prefill_tokens_per_s(llm, len(tokenizer), 256, 4, args.repeats)
        print(f"| {method or 'dense'} | {'int8' if int8_head else 'dense'} | {dtype} | {linear / MiB:.1f} "
              f"| {total / MiB:.1f} | {rate:.1f} | {forward_ms:.1f} | {head_ms:.1f} | {prefill:.0f} | {', '.join(map(str, groups)) or '-'} |", flush=True)
        del llm
    if not args.skip_linear:
        linear_crossover([1, 2, 4, 8, 16, 32, 64])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
