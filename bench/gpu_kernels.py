"""Benchmark Cadence's Triton kernels on a GPU against ceilings measured on the same device.

    python bench/gpu_kernels.py --out DIR               # everything; --budget-s (540) keeps it in 10 min
    python bench/gpu_kernels.py --quick --only quant    # fewer sizes, one section
    TRITON_INTERPRET=1 python bench/gpu_kernels.py --smoke   # CPU: tiny shapes, checks only

On the lent GPU machine (no `pip install` there; the script imports this checkout itself):
    set -o pipefail; PYTHONUNBUFFERED=1 python3 bench/gpu_kernels.py --out $OUT 2>&1 | tee $OUT/log

Sections (each case is checked against the kernel module's ``reference()`` on fresh
random inputs, output pre-filled with NaN, before it is timed):

* ceilings  -- a 1 GiB device-to-device copy (bytes read + written) and 8192^3 fp16/bf16
  matmuls: the 100% that every % below refers to.
* quant     -- W8A16 and W4A16 (group 128, symmetric and zero-point) against dense fp16
  and bf16 ``F.linear`` at Llama-3-8B shapes, M = 1..256; W8A8 FP8 too
  (its Triton kernel, and torch._scaled_mm where fp8_matmul would pick that; GPUs below
  compute capability 8.9 skip it). Bytes = weight (with scales/zeros) + x + out.
* attention -- paged decode (1 query token per sequence) over fp16/int8/fp8 KV caches;
  the split count the wrapper picks (``choose_num_splits``) against one split.
  Bytes = K + V (+ scales) + q + out.
* moe       -- fused MoE (dense fp16 / int8 / int4 experts), eager and CUDA-graph
  replays, against a plain-torch per-expert loop. Bytes = the experts routed to + x + out.

Timing: CUDA-graph replays of 20+ back-to-back calls, median per call
(``common/gpu_timing.graph_time_us``; do_bench's eager calls timed the Python launch path
for kernels this short), cycling through enough input sets to span 4x the L2; a call
that cannot be captured falls back to do_bench. The moe section's "eager" and "graph"
rows therefore time the same thing now. The compact table prints last (the device
tool returns only the tail of the output); ``--out DIR`` also writes kernels.json and
kernels.md with every figure. Exit status 1 if any correctness check failed.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

from common.attention_section import bench_attention
from common.gpu_timing import measure_ceilings, rotation_sets
from common.kernel_bench import BF16, F16, Bench, Sizes, poisoned_check
from common.kernel_report import TOLERANCE, Report, device_info, import_cadence_from_repo, nbytes
from common.moe_section import bench_moe

SECTIONS = ("ceilings", "quant", "attention", "moe")


def pick_sizes(args: argparse.Namespace, num_sms: int) -> Sizes:
    if args.smoke:  # ragged on purpose: partial tiles, two int4 groups, a partial KV block
        return Sizes(
            {"tiny": (128, 48)},
            [1, 5, 33, 256],
            64,
            (8, 2, 32, 16),
            [40, 64],
            [1, 3],
            {"tiny": (4, 2, 64, 32)},
            [1, 5, 33],
            num_sms,
            force_split=True,
        )
    llama8b = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
    moe = {"mixtral": (8, 2, 4096, 14336), "qwen-moe": (60, 4, 2048, 1408)}
    if args.quick:
        return Sizes(llama8b, [1, 16, 128], 128, (32, 8, 128, 16), [1024, 8192, 32768], [1, 32], moe, [1, 64], num_sms)
    return Sizes(
        llama8b,
        [1, 2, 3, 4, 8, 16, 32, 64, 128, 256, 512, 2048],
        128,
        (32, 8, 128, 16),
        [1024, 2048, 4096, 8192, 16384, 32768],
        [1, 8, 32],
        moe,
        [1, 4, 16, 64, 256],
        num_sms,
    )


# ---------------------------------------------------------------- quantized GEMM


def load_fp8_matmul(on_gpu: bool) -> tuple[object | None, str]:
    """kernels/triton/w8a8_fp8.py, where the device can run it."""
    if importlib.util.find_spec("cadence.kernels.triton.w8a8_fp8") is None:
        return None, "kernels/triton/w8a8_fp8.py not present"
    if on_gpu and torch.cuda.get_device_capability() < (8, 9):
        return None, "fp8 needs compute capability 8.9+"
    mod = importlib.import_module("cadence.kernels.triton.w8a8_fp8")
    if not callable(getattr(mod, "fp8_matmul", None)) or not callable(getattr(mod, "reference", None)):
        return None, "w8a8_fp8 has no fp8_matmul()/reference()"
    return mod, ""


def bench_quant(b: Bench) -> None:
    b.rep.baselines["quant"] = "fp16"
    fp8, why = load_fp8_matmul(b.on_gpu)
    print(f"  fp8 W8A8: {'included' if fp8 else 'skipped (' + why + ')'}")
    for name, (k, n) in b.sizes.quant_shapes.items():
        if b.rep.out_of_time():
            b.skip("quant", name, "time budget spent")
            continue
        fp8 = quant_shape(b, name, k, n, fp8)
        if b.on_gpu:
            torch.cuda.empty_cache()  # this shape's weights are gone; keep the pool from fragmenting
    gemv = [r for r in b.rep.records if r.section == "quant" and r.case.endswith(" M=1") and r.variant.startswith("w4")]
    if b.on_gpu and gemv:
        met = [f"{r.case.split()[0]} {r.variant.split()[-1]} {r.derived.get('pct_bw', 0):.0f}%" for r in gemv]
        ok = all(r.derived.get("pct_bw", 0) >= 85 for r in gemv)
        b.rep.targets.append(f"W4A16 GEMV at M=1 >= 85% of copy BW: {'MET' if ok else 'NOT MET'} ({', '.join(met)})")


def quant_shape(b: Bench, name: str, k: int, n: int, fp8: object | None) -> object | None:
    """Every M for one (K, N); returns the fp8 module, or None once its API proved different."""
    from cadence.kernels.formats.quant_formats import quantize_int4, quantize_int8
    from cadence.kernels.triton import w4a16, w8a16

    group = b.sizes.group
    w4_sym, w4_asym = f"w4 g{group} sym", f"w4 g{group} asym"
    sets = rotation_sets(n * k / 2 + n * k // group * 2, b.l2)  # sized by the smallest, int4
    weights = []
    for _ in range(sets):
        w = b.randn(n, k, scale=k**-0.5)  # unit-variance outputs: no fp16 overflow
        ws = {
            "fp16": w,
            "bf16": w.to(BF16),
            "w8a16": quantize_int8(w),
            w4_sym: quantize_int4(w, group, True),
            w4_asym: quantize_int4(w, group, False),
        }
        if fp8 is not None:
            ws["fp8"] = importlib.import_module("cadence.kernels.formats.fp8_format").quantize_fp8_weight(w)
        weights.append(ws)
    kernels: dict[str, tuple[Callable, Callable]] = {
        "w8a16": (lambda x, wt, out: w8a16.w8a16_matmul(x, *wt, out=out), lambda x, wt: w8a16.reference(x, *wt)),
        w4_sym: (lambda x, wt, out: w4a16.w4a16_matmul(x, wt, out=out), w4a16.reference),
        w4_asym: (lambda x, wt, out: w4a16.w4a16_matmul(x, wt, out=out), w4a16.reference),
    }
    # From 256 rows, both sides of the tiled / dequantize-then-matmul switch
    # (kernels/triton/dequant.py's DEQUANT_MIN_M), whichever the default picks.
    both_paths: dict[str, tuple[Callable, Callable]] = {
        "w8a16 tiled": (
            lambda x, wt, out: w8a16.w8a16_matmul(x, *wt, out=out, dequant_min_m=1 << 62),
            kernels["w8a16"][1],
        ),
        "w8a16 dequant+mm": (
            lambda x, wt, out: w8a16.w8a16_matmul(x, *wt, out=out, dequant_min_m=1),
            kernels["w8a16"][1],
        ),
        f"{w4_sym} tiled": (
            lambda x, wt, out: w4a16.w4a16_matmul(x, wt, out=out, dequant_min_m=1 << 62),
            w4a16.reference,
        ),
        f"{w4_sym} dequant+mm": (
            lambda x, wt, out: w4a16.w4a16_matmul(x, wt, out=out, dequant_min_m=1),
            w4a16.reference,
        ),
    }
    # Where the tiled kernels split K by default (one M block; int4 above its GEMV's rows),
    # the same kernels unsplit, to tune launch.TILED_PROGRAMS_PER_SM.
    unsplit: dict[str, tuple[Callable, Callable, range]] = {
        "w8a16 unsplit": (
            lambda x, wt, out: w8a16.w8a16_matmul(x, *wt, out=out, k_splits=1),
            kernels["w8a16"][1],
            range(1, 65),
        ),
        f"{w4_sym} unsplit": (
            lambda x, wt, out: w4a16.w4a16_matmul(x, wt, out=out, k_splits=1),
            w4a16.reference,
            range(w4a16.DEFAULT_SMALL_M_THRESHOLD + 1, 65),
        ),
    }
    for m in b.sizes.quant_m:
        if b.rep.out_of_time():
            b.skip("quant", f"{name} M={m}", "time budget spent")
            continue
        case, flops, io_bytes = f"{name} M={m}", 2 * m * n * k, 2 * (m * k + m * n)
        xs = [b.randn(m, k) for _ in range(sets)]
        for dense in ("fp16", "bf16"):
            xd = [x.to(weights[0][dense].dtype) for x in xs]
            calls = [lambda i=i, d=dense: F.linear(xd[i], weights[i][d]) for i in range(sets)]
            b.run("quant", case, dense, calls, None, n * k * 2 + io_bytes, flops, rate=dense)
        outs = [torch.empty(m, n, device=b.dev, dtype=F16) for _ in range(sets)]
        variants = {**kernels, **both_paths} if m >= 256 else dict(kernels)
        variants.update({v: (kernel, ref) for v, (kernel, ref, rows) in unsplit.items() if m in rows})
        for variant, (kernel, reference) in variants.items():
            wkey = variant.removesuffix(" tiled").removesuffix(" dequant+mm").removesuffix(" unsplit")
            calls = [lambda i=i, v=wkey, f=kernel: f(xs[i], weights[i][v], outs[i]) for i in range(sets)]
            ref = reference(xs[0], weights[0][wkey])
            b.run(
                "quant",
                case,
                variant,
                calls,
                poisoned_check(calls[0], outs[0], ref),
                nbytes(weights[0][wkey]) + io_bytes,
                flops,
            )
        if fp8 is not None:
            fp8 = bench_fp8(b, fp8, case, xs, weights, outs, io_bytes, flops)
    return fp8


def bench_fp8(
    b: Bench,
    mod: object,
    case: str,
    xs: list[torch.Tensor],
    weights: list[dict],
    outs: list[torch.Tensor],
    io_bytes: int,
    flops: int,
) -> object | None:
    """W8A8 FP8: the Triton kernel, and torch._scaled_mm where fp8_matmul would pick it.

    Reads the API fp8_matmul(x, wq, w_scale, out=, allow_scaled_mm=) and reference(xq,
    x_scale, wq, w_scale, out_dtype). Any other API disables the variant (a printed note)
    instead of failing the run.
    """
    from cadence.kernels.formats.fp8_format import quantize_fp8_per_token

    try:
        wq, w_scale = weights[0]["fp8"]
        # Both quantize x with the same function, so only accumulation order and output rounding differ.
        ref = mod.reference(*quantize_fp8_per_token(xs[0]), wq, w_scale, xs[0].dtype)  # type: ignore[attr-defined]
        paths = {"fp8 triton": {"allow_scaled_mm": False}}
        usable = getattr(mod, "scaled_mm_usable", None)
        if b.on_gpu and usable is not None and usable(xs[0], *wq.shape):
            paths["fp8 scaled_mm"] = {}
    except (TypeError, AttributeError) as exc:
        print(f"  fp8 W8A8 disabled: w8a8_fp8's API differs from what this script reads: {exc}")
        return None
    for label, kwargs in paths.items():
        calls = [
            lambda i=i, kw=kwargs: mod.fp8_matmul(xs[i], *weights[i]["fp8"], out=outs[i], **kw)  # type: ignore[attr-defined]
            for i in range(len(xs))
        ]
        # _scaled_mm returns bf16 (then cast to x's dtype): bf16 output rounding sets the bound.
        b.run(
            "quant",
            case,
            label,
            calls,
            poisoned_check(calls[0], outs[0], ref),
            nbytes(weights[0]["fp8"]) + io_bytes,
            flops,
            tol=TOLERANCE[BF16],
            rate="fp8",
        )
    return mod


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--only",
        nargs="+",
        choices=SECTIONS,
        default=list(SECTIONS),
        help="sections to run (the ceilings are always measured)",
    )
    p.add_argument("--quick", action="store_true", help="fewer M values, contexts and MoE sizes")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="tiny shapes; on a machine without CUDA it runs the Triton interpreter on CPU",
    )
    p.add_argument("--m", type=int, nargs="+", help="the quantized GEMM section's M values (overrides --quick's)")
    p.add_argument("--out", help="folder for kernels.json and kernels.md (rewritten after each section)")
    p.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="skip remaining cases after this many seconds, so the tables print inside a 10-minute call",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
    if not on_gpu:
        if not args.smoke:
            print("no CUDA device (or TRITON_INTERPRET=1): only --smoke runs here", file=sys.stderr)
            return 2
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    import_cadence_from_repo()
    device = "cuda" if on_gpu else "cpu"
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0) if on_gpu else None
    # No cache to defeat in the interpreter: 0 gives the minimum of two input sets.
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20) if props else 0
    # The interpreter has no SMs: 8 is paged_attention's own nominal CPU figure.
    sizes = pick_sizes(args, props.multi_processor_count if props else 8)
    if args.m:
        sizes.quant_m = args.m
    report = Report(device_info(device), on_gpu, args.budget_s)
    print(report.header()[2], flush=True)
    report.ceilings = measure_ceilings(device, args.smoke)
    print(report.header()[3] if on_gpu else "ceilings measured (CPU: not used)", flush=True)
    bench = Bench(report, device, sizes, l2_bytes)
    for section, fn in (("quant", bench_quant), ("attention", bench_attention), ("moe", bench_moe)):
        if section in args.only:
            print(f"== {section} ({report.info['device']})", flush=True)
            fn(bench)
            report.write(args.out)
    report.write(args.out)
    print("\n" + report.markdown(full=False))
    return 1 if report.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
