"""Where a decode step's time goes at a batch size: the device's kernels or the host.

    python bench/step_profile.py                                   # 8B-shaped, bf16 and int4, B = 1/64/256
    python bench/step_profile.py --weights bf16 --batches 256 --top 12
    python bench/step_profile.py --smoke                           # a tiny model on CPU: checks the script

For each weight format and batch size, B greedy requests with 128-token prompts are
stepped through their prefill, then torch.profiler records ``--steps`` pure decode steps
(CUDA graphs on, as served). Per step it prints the wall time, the time the device spent
in kernels (the sum of every kernel's duration: kernels overlap little in a decode step),
and their ratio: near 100% the GPU bounds the step; well below, the host does (Python,
the scheduler, sampling, launches outside the graph). Then the ops with the most host
time and, on a GPU, the kernels with the most device time, each per step.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from cadence import LLM, SamplingParams
from cadence.engine.protocol import EngineCoreRequest
from common.decode_profile import step_until_decoding
from common.random_llama import TINY, add_shape_arguments, build_random_model, llama3_shaped, runs_on_gpu

QUANTIZATION = {"bf16": None, "int8": "int8", "int4": "int4"}
PROMPT_LEN = 128


def decode_ready(llm: LLM, batch: int, max_tokens: int, vocab: int) -> None:
    """Add ``batch`` requests and step until every one of them is decoding."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab - 1, (PROMPT_LEN,), generator=gen).tolist()
        llm.engine.add_request(EngineCoreRequest(f"profile-{batch}-{i}", prompt, params))
    step_until_decoding(llm.engine, batch)


def profile_steps(llm: LLM, steps: int, on_gpu: bool) -> tuple[float, float, profile]:
    """(wall s per step, device kernel s per step, the profile) over ``steps`` decode steps."""
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_gpu else [])]
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            llm.engine.step()
        if on_gpu:
            torch.cuda.synchronize()
        wall = (time.perf_counter() - start) / steps
    device_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return wall, device_us / 1e6 / steps, prof


def top_rows(prof: profile, steps: int, top: int, on_device: bool) -> list[str]:
    """The ``top`` host ops by self CPU time, or device kernels (and copies) by time, per step."""
    key = "self_device_time_total" if on_device else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if (e.device_type == DeviceType.CUDA) == on_device]
    rows = sorted(events, key=lambda e: getattr(e, key), reverse=True)[:top]
    return [f"    {getattr(e, key) / 1e3 / steps:8.2f} ms  {e.count // steps:5d} x  {e.key[:90]}" for e in rows]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_shape_arguments(ap)
    ap.add_argument("--weights", nargs="+", choices=list(QUANTIZATION), default=["bf16", "int4"])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--smoke", action="store_true", help="a tiny model on CPU")
    args = ap.parse_args(argv)
    on_gpu = runs_on_gpu(args.smoke)
    if args.smoke:
        name, config = "tiny-llama", TINY
        args.batches, args.steps = [b for b in args.batches if b <= 4] or [2], 3
    else:
        name, config = llama3_shaped(args.hidden, args.intermediate, args.layers)
    path = build_random_model(name, config, fast=on_gpu)
    device = torch.cuda.get_device_name() if on_gpu else "CPU (smoke)"
    print(f"# decode steps on {device}: {name}, {PROMPT_LEN}-token prompts, torch {torch.__version__}\n")
    print("| weights | batch | wall ms / step | device kernels ms / step | device busy |")
    print("|---|---:|---:|---:|---:|")
    details = []
    for weights in args.weights:
        llm = LLM(
            path,
            dtype="bfloat16" if on_gpu else "float32",
            quantization=QUANTIZATION[weights],
            max_num_seqs=max(args.batches),
            max_model_len=PROMPT_LEN + 64,
        )
        for batch in args.batches:
            decode_ready(llm, batch, max_tokens=args.steps + 8, vocab=config["vocab_size"])
            wall, device, prof = profile_steps(llm, args.steps, on_gpu)
            while llm.engine.has_unfinished_requests():
                llm.engine.step()
            busy = f"{100 * device / wall:.0f}%" if on_gpu else "-"
            print(f"| {weights} | {batch} | {1e3 * wall:.2f} | {1e3 * device:.2f} | {busy} |", flush=True)
            details.append(f"{weights}, batch {batch}: host ops by self CPU time, per step")
            details += top_rows(prof, args.steps, args.top, on_device=False)
            if on_gpu:
                details.append(f"{weights}, batch {batch}: device kernels by time, per step")
                details += top_rows(prof, args.steps, args.top, on_device=True)
        del llm
        if on_gpu:
            torch.cuda.empty_cache()
    print("\n" + "\n".join(details))
    return 0


if __name__ == "__main__":
    sys.exit(main())
