"""Whole-model batch-1 decode on a GPU: dense bf16 against int8 and int4 weights.

    python bench/gpu_decode.py                 # a random Llama-3.2-1B-shaped model
    python bench/gpu_decode.py --layers 32 --hidden 4096 --intermediate 14336   # 8B-shaped
    python bench/gpu_decode.py --no-eager --quantize-lm-head   # adds int8/int4 with an int8 LM head

The model has random weights (speed does not depend on their values), built once under
bench/out/models/. Decode rate is bench/quant.py's: the time of a 1 + N token generation
minus a 1-token one, through the whole engine (scheduler, sampler, detokenizer). Each
weight format runs with decode CUDA graphs (the default) and with --enforce-eager.
"graph GPU ms" replays the captured batch-1 forward alone, timed with CUDA events: the
decoder layers' GPU time, whose weight bytes over that time give "layers GB/s".
"""

from __future__ import annotations

import argparse

import torch

from cadence import LLM
from common.engine_timing import decode_tokens_per_s
from common.gpu_timing import replay_median_ms
from common.random_llama import build_random_model


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=8192)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    ap.add_argument("--no-eager", action="store_true", help="skip the --enforce-eager runs (they are slow at 8B)")
    ap.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="also run int8 and int4 with the int8 LM head (--quantize-lm-head)",
    )
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    shape = dict(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=0,
        eos_token_id=0,
    )
    path = build_random_model(f"llama-h{args.hidden}-l{args.layers}-i{args.intermediate}-bf16", shape, fast=True)
    prompt = torch.randint(3, 128000, (32,), generator=torch.Generator().manual_seed(0)).tolist()
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


def replay_ms(llm: LLM, replays: int = 200) -> float:
    """Median GPU time of one replay of the batch-1, unsplit decode graph."""
    return replay_median_ms(llm.engine.runner.decode_graphs._captured[(1, 1)].graph, replays)


if __name__ == "__main__":
    raise SystemExit(main())
