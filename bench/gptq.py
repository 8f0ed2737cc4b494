"""GPTQ against round-to-nearest int4 on SmolLM2: perplexity on a fixed text.

    python bench/gptq.py                                 # 128 self-generated samples x 256 tokens
    python bench/gptq.py --samples 32 --sample-length 256 --no-sym

Writes a GPTQ checkpoint with `cadence quantize`'s code (engine/quantization/gptq_model.py)
into a temporary folder, serves it, and scores the 317-token text of tests/quant_eval.py
(never used for calibration). In the same process: the dense model, and round-to-nearest
int4 at the same group size (`--quantization int4` uses per-layer groups, so RTN here is
applied to the same single group GPTQ used).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from quant_eval import EVAL_TEXT, perplexity  # noqa: E402

from cadence import LLM  # noqa: E402
from cadence.engine.default_model import resolve_model_path  # noqa: E402
from cadence.engine.quantization.gptq_model import quantize_checkpoint  # noqa: E402
from cadence.engine.quantization.linear import Int4Linear  # noqa: E402
from cadence.kernels.quant_formats import quantize_int4  # noqa: E402


def rtn_perplexity(path: str, group: int, symmetric: bool, ids: list[int]) -> float:
    """The dense model with every projection rounded to int4 at ``group`` (Int4Linear, CPU op)."""
    llm = LLM(path, dtype="float32", max_model_len=1024, num_gpu_blocks=128)
    model = llm.engine.model
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
            parent, child = name.rsplit(".", 1)
            weight = quantize_int4(module.weight.detach(), group, symmetric, scale_dtype=torch.float16)
            setattr(model.get_submodule(parent), child, Int4Linear(weight))
    return perplexity(llm, ids)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--sym", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--sample-length", type=int, default=256)
    ap.add_argument("--calibration-file", default=None)
    args = ap.parse_args(argv)
    path = resolve_model_path(args.model)
    dense = LLM(path, dtype="float32", max_model_len=1024, num_gpu_blocks=128)
    ids = dense.get_tokenizer()(EVAL_TEXT)["input_ids"]
    dense_ppl = perplexity(dense, ids)
    del dense
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        done = quantize_checkpoint(path, out, args.group_size, args.sym, args.samples, args.sample_length,
                                   args.calibration_file)
        seconds = time.perf_counter() - start
        gptq_ppl = perplexity(LLM(out, dtype="float32", max_model_len=1024, num_gpu_blocks=128), ids)
    rtn_ppl = rtn_perplexity(path, int(done["group_size"]), args.sym, ids)  # type: ignore[call-overload]
    print(f"# GPTQ on {os.path.basename(path)} ({time.strftime('%Y-%m-%d %H:%M')}): group {done['group_size']}, "
          f"{'symmetric' if args.sym else 'zero points'}, calibration {done['source']} "
          f"{done['samples']} x {done['tokens_per_sample']}; quantizing took {seconds:.0f} s\n")
    print("| weights | perplexity | vs dense |")
    print("|---|---:|---:|")
    for label, value in (("dense", dense_ppl), ("int4 round-to-nearest", rtn_ppl), ("int4 GPTQ", gptq_ppl)):
        print(f"| {label} | {value:.3f} | {100 * (value / dense_ppl - 1):+.2f}% |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
