"""Whole-model batch-1 decode on a GPU: dense bf16 against int8 and int4 weights.

    python bench/gpu_decode.py                 # a random Llama-3.2-1B-shaped model
    python bench/gpu_decode.py --layers 32 --hidden 4096 --intermediate 14336   # 8B-shaped
    python bench/gpu_decode.py --no-eager --quantize-lm-head   # adds int8/int4 with an int8 LM head
    python bench/gpu_decode.py --batch-invariant   # what --batch-invariant costs at batch 1/16/64

The model has random weights (speed does not depend on their values), built once under
bench/out/models/. Decode rate is bench/quant.py's: the time of a 1 + N token generation
minus a 1-token one, through the whole engine (scheduler, sampler, detokenizer). Each
weight format runs with decode CUDA graphs (the default) and with --enforce-eager.
"graph GPU ms" replays the captured batch-1 forward alone, timed with CUDA events: the
decoder layers' GPU time, whose weight bytes over that time give "layers GB/s".

``--batch-invariant`` prints instead, per weight format, the decode rate (tokens/s over
the whole batch, with graphs) at batch 1, 16 and 64, default against ``batch_invariant=True``.
"""

from __future__ import annotations

import argparse
import time

import torch

from cadence import LLM, SamplingParams
from common.engine_timing import decode_tokens_per_s
from common.gpu_timing import replay_median_ms
from common.random_llama import add_shape_arguments, build_random_model, llama3_shaped


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap, layers=16, hidden=2048, intermediate=8192)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--no-eager", action="store_true", help="skip the --enforce-eager runs (they are slow at 8B)")
    ap.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="also run int8 and int4 with the int8 LM head (--quantize-lm-head)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="compare decode with and without --batch-invariant at batch 1, 16 and 64 instead",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    path = build_random_model(*llama3_shaped(args.hidden, args.intermediate, args.layers), fast=True)
    prompt = torch.randint(3, 128000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
    if args.batch_invariant:
        return invariant_cost(path, prompt, args)
    print(
        f"# batch-1 decode on {torch.cuda.get_device_name()}: hidden {args.hidden}, {args.layers} layers, "
        f"intermediate {args.intermediate}, {args.dtype}, torch {torch.__version__}\n"
    )
    print("| weights | graphs tok/s | vs dense | eager tok/s | graphs / eager | graph GPU ms | layers GB/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    base = None
    runs = [(None, False), ("int8", False), ("int4", False)]
    if args.quantize_lm_head:
        runs += [("int8", True), ("int4", True)]
    for method, int8_head in runs:
        rates = {}
        for eager in (False,) if args.no_eager else (False, True):
            llm = LLM(
                path,
                dtype=args.dtype,
                quantization=method,
                quantize_lm_head=int8_head,
                max_model_len=1024,
                num_gpu_blocks=256,
                enforce_eager=eager,
            )
            rates[eager] = decode_tokens_per_s(llm, prompt, args.new_tokens, args.repeats)
            if not eager:
                gpu_ms = replay_ms(llm)
                layer_bytes = sum(
                    t.numel() * t.element_size()
                    for t in [*llm.engine.model.model.layers.parameters(), *llm.engine.model.model.layers.buffers()]
                )
            del llm
            torch.cuda.empty_cache()
        base = base or rates[False]
        eager_cells = f"{rates[True]:.1f} | {rates[False] / rates[True]:.2f}x" if True in rates else "- | -"
        label = (method or "dense") + (" + int8 head" if int8_head else "")
        print(
            f"| {label} | {rates[False]:.1f} | {rates[False] / base:.2f}x | {eager_cells} | "
            f"{gpu_ms:.3f} | {layer_bytes / gpu_ms / 1e6:.0f} |",
            flush=True,
        )
    return 0


INVARIANT_BATCHES = (1, 16, 64)


def invariant_cost(path: str, prompt: list[int], args: argparse.Namespace) -> int:
    """Decode tokens/s per weight format and batch size, default against --batch-invariant."""
    print(
        f"# decode with and without --batch-invariant on {torch.cuda.get_device_name()}: hidden {args.hidden}, "
        f"{args.layers} layers, intermediate {args.intermediate}, {args.dtype}, CUDA graphs, "
        f"torch {torch.__version__}\n"
    )
    print("| weights | batch | default tok/s | invariant tok/s | invariant / default |")
    print("|---|---:|---:|---:|---:|")
    blocks_per_seq = -(-(len(prompt) + 1 + args.new_tokens) // 16)
    for method in (None, "int8", "int4"):
        rates: dict[tuple[bool, int], float] = {}
        for invariant in (False, True):
            llm = LLM(
                path,
                dtype=args.dtype,
                quantization=method,
                max_model_len=1024,
                max_num_seqs=max(INVARIANT_BATCHES),
                num_gpu_blocks=max(256, max(INVARIANT_BATCHES) * blocks_per_seq + 16),
                batch_invariant=invariant,
            )
            for batch in INVARIANT_BATCHES:
                rates[invariant, batch] = batch_decode_tokens_per_s(llm, prompt, batch, args.new_tokens, args.repeats)
            del llm
            torch.cuda.empty_cache()
        for batch in INVARIANT_BATCHES:
            default, invariant_rate = rates[False, batch], rates[True, batch]
            print(
                f"| {method or 'dense'} | {batch} | {default:.1f} | {invariant_rate:.1f} | "
                f"{invariant_rate / default:.2f}x |",
                flush=True,
            )
    return 0


def batch_decode_tokens_per_s(llm: LLM, prompt: list[int], batch: int, new_tokens: int, repeats: int) -> float:
    """Decode rate of ``batch`` greedy requests at once, over all of them: the time for
    1 + new_tokens tokens each minus the time for 1, per generated token. The prompts
    differ in their first token, so no request reads another's KV blocks."""
    prompts = [{"prompt_token_ids": [3 + i, *prompt[1:]]} for i in range(batch)]

    def run(n: int) -> float:
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params)
        return time.perf_counter() - start

    run(4)  # warm-up: first calls allocate
    best = min(run(1 + new_tokens) - run(1) for _ in range(repeats))
    return batch * new_tokens / best


def replay_ms(llm: LLM, replays: int = 200) -> float:
    """Median GPU time of one replay of the batch-1, unsplit decode graph."""
    return replay_median_ms(llm.engine.runner.decode_graphs._captured[(1, 1)].graph, replays)


if __name__ == "__main__":
    raise SystemExit(main())
