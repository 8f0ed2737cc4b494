"""Which linear-layer path is fastest on this CPU, by batch size: the data for CPU dispatch.

Times `y = x @ W.T` for one weight shape at several M, through every CPU path torch
offers: fp32, fp16 and bf16 dense matmul, `_weight_int8pack_mm` (int8 weights, per-channel
scales) and `_weight_int4pack_mm_for_cpu` (int4 weights, group-wise scales and zeros).
With ``--fp8``, also the ways to serve an FP8 W8A8 weight (e4m3, a scale per output
channel; x quantized per token inside every timed call): `Fp8Linear` itself (codes
decoded to fp16 with integer ops, fp16 matmul, scales on the output), `torch._scaled_mm`,
and torch's own fp8 -> bf16 cast before a bf16 matmul. Prints microseconds per call and
GFLOP/s, and the fastest path per M.

Each cell is the best of ``--rounds`` medians (common/timer.time_call), so a neighbour's
burst on a shared machine inflates a round, not the table; the run also reports how many
cores other processes used meanwhile.

    python bench/cpu_linear.py                       # 2048 x 2048, M = 1 16 64 256
    python bench/cpu_linear.py --n 1536 --k 576      # SmolLM2-135M's MLP up-projection
    python bench/cpu_linear.py --n 1536 --k 576 --fp8 --rounds 3
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from common.machine import Contention, machine_info, machine_line
from common.timer import time_call


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
    paths[f"int4pack g{group_size} (bf16 act.)"] = lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(
        xb, packed, group_size, scales_and_zeros
    )
    return paths


def fp8_paths(n: int, k: int, m: int) -> dict[str, Callable[[], torch.Tensor]]:
    """FP8 W8A8 on CPU: the layer's own path and the torch ops it was chosen over."""
    from cadence.engine.quantization.fp8_linear import Fp8Linear
    from cadence.kernels.formats.fp8_format import quantize_fp8_per_token

    torch.manual_seed(0)
    linear = nn.Linear(k, n, bias=False).requires_grad_(False)
    nn.init.normal_(linear.weight, std=k**-0.5)
    fp8 = Fp8Linear.from_linear(linear)
    wq, w_scale = fp8.qweight, fp8.weight_scale
    x32 = torch.randn(m, k)
    xb = x32.bfloat16()

    def scaled_mm() -> torch.Tensor:
        xq, x_scale = quantize_fp8_per_token(xb)
        return torch._scaled_mm(
            xq, wq.t(), scale_a=x_scale[:, None], scale_b=w_scale[None, :], out_dtype=torch.bfloat16
        )

    def torch_cast_codes() -> torch.Tensor:
        xq, x_scale = quantize_fp8_per_token(xb)
        y = F.linear(xq.to(torch.bfloat16), wq.to(torch.bfloat16))
        return (y.float() * x_scale[:, None] * w_scale).bfloat16()

    return {
        "Fp8Linear (fp32 act.)": lambda: fp8(x32),
        "Fp8Linear (bf16 act.)": lambda: fp8(xb),
        "fp8 _scaled_mm (bf16 act.)": scaled_mm,
        "fp8 .to(bf16) + bf16 mm": torch_cast_codes,
        "(per-token fp8 quantize of x alone)": lambda: quantize_fp8_per_token(xb)[0],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2048, help="output features")
    ap.add_argument("--k", type=int, default=2048, help="input features")
    ap.add_argument("--m", type=int, nargs="+", default=[1, 16, 64, 256], help="batch rows")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--fp8", action="store_true", help="also the FP8 W8A8 paths")
    ap.add_argument("--rounds", type=int, default=1, help="repeat every measurement; keep the best median")
    args = ap.parse_args(argv)
    info = machine_info()
    print(f"# CPU linear paths, {args.n}x{args.k} weight ({time.strftime('%Y-%m-%d %H:%M')})")
    print(machine_line(info))
    results: dict[str, dict[int, float]] = {}
    with Contention() as contention:
        for _ in range(args.rounds):
            for m in args.m:
                paths = build_paths(args.n, args.k, m, args.group_size)
                if args.fp8:
                    paths.update(fp8_paths(args.n, args.k, m))
                for name, fn in paths.items():
                    best = results.setdefault(name, {}).get(m, float("inf"))
                    results[name][m] = min(best, time_call(fn))
    print(f"best of {args.rounds} medians; other processes used {contention.other_cores:.2f} cores meanwhile\n")
    print("| path | " + " | ".join(f"M={m} µs (GFLOP/s)" for m in args.m) + " |")
    print("|---|" + "---|" * len(args.m))
    for name, by_m in results.items():
        cells = [f"{by_m[m]:,.0f} ({2 * m * args.n * args.k / by_m[m] / 1e3:.1f})" for m in args.m]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print()
    for m in args.m:
        # The quantize-alone row is a part of the fp8 paths, not a path.
        best = min((name for name in results if not name.startswith("(")), key=lambda name: results[name][m])
        print(f"fastest at M={m}: {best} ({results[best][m] / results['fp32'][m]:.2f}x the fp32 time)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
