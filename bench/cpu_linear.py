"""Which linear-layer path is fastest on this CPU, by batch size: the data for CPU dispatch.

Times `y = x @ W.T` for one weight shape at several M, through every CPU path torch
offers: fp32, fp16 and bf16 dense matmul, `_weight_int8pack_mm` (int8 weights, per-channel
scales) and `_weight_int4pack_mm_for_cpu` (int4 weights, group-wise scales and zeros).
Prints microseconds per call and GFLOP/s, and the fastest path per M.

    python bench/cpu_linear.py                       # 2048 x 2048, M = 1 16 64 256
    python bench/cpu_linear.py --n 1536 --k 576      # SmolLM2-135M's MLP up-projection
"""
from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from machine import machine_info


def cpu_flags() -> list[str]:
    """The ISA extensions that decide which kernels the CPU can run fast."""
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile")
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    except OSError:
        return []
    return [flag for flag in wanted if flag in flags]


def time_call(fn: Callable[[], torch.Tensor], min_seconds: float = 0.3) -> float:
    """Median microseconds per call over at least `min_seconds` of repeats, after warm-up."""
    for _ in range(3):
        fn()
    samples: list[float] = []
    spent = 0.0
    while spent < min_seconds or len(samples) < 5:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        samples.append(elapsed)
        spent += elapsed
    samples.sort()
    return samples[len(samples) // 2] * 1e6


def build_paths(n: int, k: int, m: int, group_size: int) -> dict[str, Callable[[], torch.Tensor]]:
    torch.manual_seed(0)
    weight = torch.randn(n, k) / k**0.5
    x32 = torch.randn(m, k)
    paths: dict[str, Callable[[], torch.Tensor]] = {}
    for name, dtype in (("fp32", torch.float32), ("fp16", torch.float16), ("bf16", torch.bfloat16)):
        w, x = weight.to(dtype), x32.to(dtype)
        paths[name] = lambda w=w, x=x: torch.nn.functional.linear(x, w)

    scale = weight.abs().amax(dim=1) / 127.0
    w8 = torch.round(weight / scale[:, None]).clamp(-128, 127).to(torch.int8)
    paths["int8pack (fp32 act.)"] = lambda: torch.ops.aten._weight_int8pack_mm(x32, w8, scale)
    xb = x32.bfloat16()
    paths["int8pack (bf16 act.)"] = lambda: torch.ops.aten._weight_int8pack_mm(xb, w8, scale.bfloat16())

    # Asymmetric int4 per group along K, in the layout the CPU op expects.
    groups = weight.reshape(n, k // group_size, group_size)
    low, high = groups.amin(dim=2), groups.amax(dim=2)
    step = ((high - low) / 15.0).clamp(min=1e-8)
    q = torch.round((groups - low[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    # The op computes (q - 8) * scale + zero, so the zero point is the group minimum shifted by 8 steps.
    scales_and_zeros = torch.stack([step.T, (low + 8 * step).T], dim=2).contiguous().bfloat16()
    paths["int4pack g%d (bf16 act.)" % group_size] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
        xb, packed, group_size, scales_and_zeros
    )
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048, help="output features")
    ap.add_argument("--k", type=int, default=2048, help="input features")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256], help="batch rows")
    ap.add_argument("--group-size", type=int, default=128)
    args = ap.parse_args(argv)
    info = machine_info()
    print(f"# CPU linear paths, {args.n}x{args.k} weight ({time.strftime('%Y-%m-%d %H:%M')})")
    print(f"cpu: {info['cpu']}, {info['cores']} cores, threads {info['threads']}, torch {info['torch']}")
    print(f"ISA: {', '.join(cpu_flags()) or 'none of the checked extensions'}\n")
    results: dict[str, dict[int, float]] = {}
    for m in args.m:
        for name, fn in build_paths(args.n, args.k, m, args.group_size).items():
            results.setdefault(name, {})[m] = time_call(fn)
    print("| path | " + " | ".join(f"M={m} µs (GFLOP/s)" for m in args.m) + " |")
    print("|---|" + "---|" * len(args.m))
    for name, by_m in results.items():
        cells = [f"{by_m[m]:,.0f} ({2 * m * args.n * args.k / by_m[m] / 1e3:.1f})" for m in args.m]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    for m in args.m:
        best = min(results, key=lambda name: results[name][m])
        print(f"fastest at M={m}: {best} ({results[best][m] / results['fp32'][m]:.2f}x the fp32 time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
