"""`cadence serve` on a GPU: output tokens/s and TTFT at batch 1, 16, 64 and 256, with CUDA
graphs against eager and bf16 against int8 and int4 weights, each beside its physical limit.

    python bench/gpu_serve.py                          # a random Llama-8B-shaped bf16 model
    python bench/gpu_serve.py --configs "bf16 graphs" "int4 graphs" --batches 1 64
    python bench/gpu_serve.py --smoke                  # a tiny model on CPU: checks the script

Each configuration is one `cadence serve` process, with prefix caching off (the same
prompts run twice). A batch of B is B streaming completions sent at once, each a fixed
random prompt of token ids and ``ignore_eos`` greedy output; every batch size runs once
unmeasured first (Triton compiles kernels on first use), then measured. "Output tok/s"
is the batch's completion tokens over the time from sending to the last stream's end;
"decode tok/s" is B times the median stream's tokens after its first over the time after
its first, which is what the decode limit bounds; TTFT is per request, from sending.

The limits (decode "limit tok/s", prefill "TTFT floor") use ceilings measured here: a
device-to-device copy for bandwidth (bytes read plus written, so a read-only stream can
pass it by a few percent) and a large bf16 matmul for compute. A decode step must read
every weight byte once and each sequence's KV; it also does 2 FLOPs per weight per row.
The batch's prefill must do 2 FLOPs per weight per prompt token. The random weights need
a tokenizer with the model's vocabulary: a word-level one, written beside them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass

import httpx
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from common.from_tests import ServerProcess
from common.gpu_timing import measure_ceilings
from common.random_llama import add_shape_arguments, build_random_model, llama3_shaped, runs_on_gpu

CONFIGS = {
    "bf16 graphs": (),
    "bf16 eager": ("--enforce-eager",),
    "int8 graphs": ("--quantization", "int8"),
    "int4 graphs": ("--quantization", "int4"),
}
BYTES_PER_WEIGHT = {"bf16": 2.0, "int8": 1.0, "int4": 0.5 + 2 / 128}  # int4: g128 bf16 scales


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    kv_heads: int
    head_dim: int
    vocab: int

    def layer_weights(self) -> int:
        kv = self.kv_heads * self.head_dim
        return self.layers * (self.hidden * (2 * self.hidden + 2 * kv) + 3 * self.hidden * self.intermediate)

    def kv_bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * 2  # K and V, bf16


@dataclass
class BatchResult:
    tokens_per_s: float
    decode_tokens_per_s: float
    ttft_p50: float
    ttft_max: float
    completion_tokens: int


def save_word_tokenizer(path: str, vocab_size: int) -> None:
    """Word-level ids 'w0'.. covering the whole vocabulary, so any id detokenizes."""
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
        return
    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="w0", bos_token="w1", eos_token="w2")
    fast.save_pretrained(path)


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], max_tokens: int, start: float
) -> tuple[float, float, int]:
    """(TTFT, end, completion tokens) of one streamed completion, times from `start`."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    first, tokens = None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if first is None and chunk.get("choices"):
                first = time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    end = time.perf_counter() - start
    return (end if first is None else first), end, tokens


async def run_batch(base_url: str, model: str, prompts: list[list[int]], max_tokens: int) -> BatchResult:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits, trust_env=False) as client:
        start = time.perf_counter()
        results = await asyncio.gather(*(one_request(client, model, p, max_tokens, start) for p in prompts))
    ttfts = [r[0] for r in results]
    tokens = sum(r[2] for r in results)
    stream_rate = statistics.median((r[2] - 1) / max(r[1] - r[0], 1e-9) for r in results)
    end = max(r[1] for r in results)
    return BatchResult(tokens / end, len(prompts) * stream_rate, statistics.median(ttfts), max(ttfts), tokens)


def limits(shape: Shape, weights: str, batch: int, prompt: int, output: int, gbps: float, tflops: float):
    """(decode tok/s limit, the batch's prefill floor in s)."""
    layer = shape.layer_weights()
    head = shape.vocab * shape.hidden  # the LM head stays bf16
    step_bytes = (
        layer * BYTES_PER_WEIGHT[weights] + head * 2 + batch * (prompt + output / 2) * shape.kv_bytes_per_token()
    )
    step_flops = 2 * (layer + head) * batch
    step_s = max(step_bytes / (gbps * 1e9), step_flops / (tflops * 1e12))
    prefill_s = 2 * (layer * prompt + head) * batch / (tflops * 1e12)  # the head only for each last token
    return batch / step_s, prefill_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap)
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on CPU, small batches")
    args = ap.parse_args(argv)
    on_gpu = runs_on_gpu(args.smoke)
    if args.smoke:
        args.layers, args.hidden, args.intermediate = 2, 128, 256
        args.batches, args.prompt_len, args.output_len = [1, 4], 16, 8
    name, config = llama3_shaped(args.hidden, args.intermediate, args.layers, kv_heads=2 if args.smoke else 8)
    path = build_random_model(name, config, fast=True)
    shape = Shape(
        args.hidden,
        args.intermediate,
        args.layers,
        config["num_key_value_heads"],
        args.hidden // config["num_attention_heads"],
        config["vocab_size"],
    )
    save_word_tokenizer(path, shape.vocab)
    ceilings = measure_ceilings("cuda" if on_gpu else "cpu", smoke=not on_gpu)
    gbps, tflops = ceilings.copy_gbps, ceilings.tflops["bf16"]
    if on_gpu:
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if on_gpu else "CPU (smoke)"
    print(
        f"# cadence serve on {name}: hidden {shape.hidden}, {shape.layers} layers, prompt {args.prompt_len}, "
        f"output {args.output_len}; ceilings: copy {gbps:.0f} GB/s, bf16 {tflops:.0f} TFLOP/s\n"
    )
    print("| config | batch | output tok/s | decode tok/s | limit | % | TTFT p50 s | TTFT max s | prefill floor s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    generator = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, shape.vocab - 1, (args.prompt_len,), generator=generator).tolist()
        for _ in range(max(args.batches))
    ]
    device_args = ("--dtype", "bfloat16") if on_gpu else ("--dtype", "float32")
    seqs = max(args.batches)
    for label in args.configs:
        extra = (
            *device_args,
            "--max-num-seqs",
            str(seqs),
            "--max-model-len",
            str(args.prompt_len + args.output_len + 16),
            "--no-enable-prefix-caching",
        )
        with ServerProcess(path, *extra, *CONFIGS[label], startup_timeout=600) as server:
            model = httpx.get(f"{server.base_url}/v1/models", timeout=10, trust_env=False).json()["data"][0]["id"]
            for batch in args.batches:  # first use compiles: unmeasured
                asyncio.run(run_batch(server.base_url, model, prompts[:batch], 4))
            for batch in args.batches:
                result = asyncio.run(run_batch(server.base_url, model, prompts[:batch], args.output_len))
                assert result.completion_tokens == batch * args.output_len, result
                limit, floor = limits(shape, label.split()[0], batch, args.prompt_len, args.output_len, gbps, tflops)
                print(
                    f"| {label} | {batch} | {result.tokens_per_s:.1f} | {result.decode_tokens_per_s:.1f} | "
                    f"{limit:.0f} | {100 * result.decode_tokens_per_s / limit:.0f}% | {result.ttft_p50:.3f} | "
                    f"{result.ttft_max:.3f} | "
                    f"{floor:.3f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
