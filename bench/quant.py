"""Quantization on CPU: memory, perplexity and speed of SmolLM2 in each weight format.

    python bench/quant.py                  # every format
    python bench/quant.py --gptq           # and GPTQ (`cadence quantize`) against rounding (minutes)
    python bench/quant.py --quick          # three formats, few tokens: a smoke run of this script

Tables:
1. one row per weight format (dense, int8, int4, fp8 W8A8, the GGUF's own blocks with
   ``--quantization gguf``), each with a dense LM head and some with the int8 one
   (``--quantize-lm-head``): bytes held by the decoder's projections (the layers
   quantization swaps) and by the whole model; perplexity on tests/quant_eval.py's fixed
   text; batch-1 decode tokens/s through `LLM.generate` (one greedy sequence, EOS
   ignored: the time of a 1 + N token generation minus a 1-token one, over N, best of a
   few repeats); the median engine step of those decodes (the engine's StepTimings) and
   the LM head's own time on one row; prefill tokens/s for 4 fresh random prompts at once;
   the CPU kernels the planner chose by rule (engine/quantization/cpu_planner.py);
2. with ``--gptq``: perplexity of a 4-bit GPTQ checkpoint written by `cadence quantize`'s
   code, against round-to-nearest at the same single group size, and dense.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
from torch import nn

from cadence import LLM
from cadence.engine.default_model import resolve_model_path
from cadence.engine.quantization import TARGET_LAYERS, Int4Linear, Int4Method
from cadence.engine.quantization.cpu_planner import group_summary
from cadence.engine.quantization.linear import dense_bytes
from common.engine_timing import decode_steps, decode_tokens_per_s, lm_head_ms, median_phases, prefill_tokens_per_s
from common.from_tests import EVAL_TEXT, perplexity
from common.machine import machine_info, machine_line

MiB = 1 << 20
# (quantization, model dtype, int8 LM head): each body with a dense head, then the
# int8-head rows (--quantize-lm-head; the gguf default when the file's head is Q8_0).
ROWS = [
    (None, "float32", False),
    (None, "bfloat16", False),
    ("int8", "float32", False),
    ("int4", "float32", False),
    ("int8", "bfloat16", False),
    ("int4", "bfloat16", False),
    ("fp8", "float32", False),
    ("fp8", "bfloat16", False),
    ("gguf", "float32", False),
    (None, "float32", True),
    ("int8", "float32", True),
    ("int4", "bfloat16", True),
    ("gguf", "float32", True),
]
QUICK_ROWS = [(None, "float32", False), ("int8", "float32", False), ("gguf", "float32", True)]


def module_bytes(module: nn.Module) -> int:
    """Bytes of a module's own parameters and buffers (not its children's), and of the
    dense, half-precision or integer kernels' copies the CPU planner kept for it (packed
    copies at their packed size)."""
    tensors = list(module.parameters(recurse=False)) + list(module.buffers(recurse=False))
    held = getattr(module, "cpu_dense_dtype", None)
    extra = 0 if held is None else dense_bytes(module, held)  # type: ignore[arg-type]
    for chunks in getattr(module, "cpu_half", {}).values():
        extra += sum(w.fmt.packed_bytes(w.out_features, w.in_features) for w in chunks.values())
    for packed in getattr(module, "cpu_int_dot", {}).values():
        extra += packed.codes.nbytes + packed.scales.nbytes
    return extra + sum(t.numel() * t.element_size() for t in tensors)


def footprint(model: nn.Module) -> tuple[int, int]:
    """(bytes in the swappable projections, bytes in the whole model)."""
    linear = sum(module_bytes(m) for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in TARGET_LAYERS)
    total = sum(module_bytes(m) for m in model.modules())
    return linear, total


def format_table(
    path: str, rows: list[tuple[str | None, str, bool]], new_tokens: int, repeats: int, prefill_len: int
) -> None:
    print(
        "| weights | LM head | model dtype | linear MiB | model MiB | perplexity | decode tok/s (batch 1) "
        f"| step ms | head ms | prefill tok/s (4 x {prefill_len}) | int4 group sizes | CPU kernels |"
    )
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|")
    # "gguf" serves the file's own blocks; it needs a model converted from a GGUF.
    has_gguf = os.path.isfile(os.path.join(path, "gguf_source.json"))
    for method, dtype, int8_head in rows:
        if method == "gguf" and not has_gguf:
            continue
        llm = LLM(
            path, dtype=dtype, quantization=method, quantize_lm_head=int8_head, max_model_len=1024, num_gpu_blocks=128
        )
        tokenizer = llm.get_tokenizer()
        assert tokenizer is not None
        text_ids = tokenizer(EVAL_TEXT)["input_ids"]
        prompt = text_ids[:32]
        linear, total = footprint(llm.engine.model)
        groups = sorted(
            {m.group_size for m in llm.engine.model.modules() if isinstance(getattr(m, "method", None), Int4Method)}
        )
        ppl = perplexity(llm, text_ids)
        rate = decode_tokens_per_s(llm, prompt, new_tokens, repeats)
        step_ms = median_phases(decode_steps(llm, prompt, new_tokens)).total * 1e3
        head_ms = lm_head_ms(llm)
        prefill = prefill_tokens_per_s(llm, len(tokenizer), prefill_len, 4, repeats)
        print(
            f"| {method or 'dense'} | {'int8' if int8_head else 'dense'} | {dtype} | {linear / MiB:.1f} "
            f"| {total / MiB:.1f} | {ppl:.3f} | {rate:.1f} | {step_ms:.1f} | {head_ms:.2f} | {prefill:.0f} "
            f"| {', '.join(map(str, groups)) or '-'} "
            f"| {', '.join(f'{n} {plan}' for plan, n in group_summary(llm.engine.model.modules()).items()) or '-'} |",
            flush=True,
        )
        del llm


def rtn_perplexity(path: str, group: int, symmetric: bool, ids: list[int]) -> float:
    """The dense model with every projection rounded to int4 at one `group` (Int4Linear, CPU op).

    `--quantization int4` picks a group per layer; GPTQ uses one for all, so rounding is
    applied here at GPTQ's group to compare like with like.
    """
    from cadence.kernels.formats.quant_formats import quantize_int4

    llm = LLM(path, dtype="float32", max_model_len=1024, num_gpu_blocks=128)
    model = llm.engine.model
    for name, module in list(model.named_modules()):
        if name.rsplit(".", 1)[-1] in TARGET_LAYERS:
            parent, child = name.rsplit(".", 1)
            weight = quantize_int4(module.weight.detach(), group, symmetric, scale_dtype=torch.float16)
            setattr(model.get_submodule(parent), child, Int4Linear(weight))
    return perplexity(llm, ids)


def gptq_table(path: str, args: argparse.Namespace) -> None:
    """Dense, int4 round-to-nearest and int4 GPTQ perplexity on the fixed text (never used to calibrate)."""
    from cadence.tools.gptq_model import quantize_checkpoint

    dense = LLM(path, dtype="float32", max_model_len=1024, num_gpu_blocks=128)
    tokenizer = dense.get_tokenizer()
    assert tokenizer is not None
    ids = tokenizer(EVAL_TEXT)["input_ids"]
    dense_ppl = perplexity(dense, ids)
    del dense
    with tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        done = quantize_checkpoint(
            path,
            out,
            args.gptq_group_size,
            args.gptq_sym,
            args.gptq_samples,
            args.gptq_sample_length,
            args.calibration_file,
        )
        seconds = time.perf_counter() - start
        gptq_ppl = perplexity(LLM(out, dtype="float32", max_model_len=1024, num_gpu_blocks=128), ids)
    group = int(done["group_size"])  # type: ignore[call-overload]
    rtn_ppl = rtn_perplexity(path, group, args.gptq_sym, ids)
    print(
        f"\nGPTQ: group {group}, {'symmetric' if args.gptq_sym else 'zero points'}, calibration "
        f"{done['source']} {done['samples']} x {done['tokens_per_sample']}; quantizing took {seconds:.0f} s\n"
    )
    print("| weights | perplexity | vs dense |")
    print("|---|---:|---:|")
    for label, value in (("dense", dense_ppl), ("int4 round-to-nearest", rtn_ppl), ("int4 GPTQ", gptq_ppl)):
        print(f"| {label} | {value:.3f} | {100 * (value / dense_ppl - 1):+.2f}% |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder or .gguf (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="three formats, 8 tokens, one repeat: a smoke run")
    ap.add_argument("--gptq", action="store_true", help="also GPTQ against round-to-nearest (takes minutes)")
    ap.add_argument("--gptq-group-size", type=int, default=128)
    ap.add_argument("--gptq-sym", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--gptq-samples", type=int, default=128)
    ap.add_argument("--gptq-sample-length", type=int, default=256)
    ap.add_argument("--calibration-file", default=None, help="GPTQ calibration text (default: self-generated)")
    args = ap.parse_args(argv)
    path = resolve_model_path(args.model)
    print(f"# Quantized SmolLM2 on CPU ({time.strftime('%Y-%m-%d %H:%M')}), {os.path.basename(path)}")
    print(f"{machine_line(machine_info())}, load average {os.getloadavg()[0]:.2f}\n")
    if args.quick:
        format_table(path, QUICK_ROWS, new_tokens=8, repeats=1, prefill_len=64)
    else:
        format_table(path, ROWS, args.new_tokens, args.repeats, prefill_len=256)
    if args.gptq:
        gptq_table(path, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
