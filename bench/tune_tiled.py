"""Sweep the tiled W4A16 and W8A16 GEMMs' launch configurations on a GPU, against dense.

    python bench/tune_tiled.py                       # Llama-8B's four projections, bf16
    python bench/tune_tiled.py --m 16 64 --kernels w4 --budget-s 120 --out DIR

For each M, every configuration (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages; for int4 also
whether each packed word is loaded once) runs the four projections, is checked against
the kernel's torch reference, and is timed from CUDA-graph replays over rotated weight
copies (``common.gpu_timing``). Printed per kernel and M: dense bf16, the current
default launch, the dequantize-then-matmul path, and the best configurations, as µs summed
over the four shapes and as a ratio to dense. The kernels' own defaults are then set from
these tables by hand, with the run recorded in bench/RESULTS.md.

Compiling hundreds of configurations one after another would take most of a device call,
so worker processes compile them first (Triton's on-disk cache), each on the same GPU,
and the timing then runs in this process alone.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common.gpu_timing import rotation_sets, time_us
from common.kernel_report import import_cadence_from_repo

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}  # (K, N)
TILES_NK = [(64, 64), (128, 64), (256, 64), (64, 128), (128, 128)]  # (BLOCK_N, BLOCK_K)
MAX_TILE_ELEMENTS = 16384  # larger fp32 tiles spill registers at 4-8 warps
TOLERANCE = 2e-2  # relative error against the reference, bf16 outputs
DEVICE = "cuda"  # --smoke: the Triton interpreter on CPU tensors, tiny shapes


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    words_once: bool = False

    def label(self) -> str:
        once = " once" if self.words_once else ""
        return f"{self.block_m}x{self.block_n}x{self.block_k} {self.num_warps}warps {self.num_stages}stages{once}"


def block_ms(m: int) -> list[int]:
    """M tiles worth trying: 16 is tl.dot's minimum; from 64 rows, two sizes."""
    return [16] if m <= 16 else [32] if m <= 32 else [32, 64] if m <= 64 else [64, 128]


def configs(kernel: str, m: int) -> list[Config]:
    out = []
    for bm, (bn, bk), warps, stages in itertools.product(block_ms(m), TILES_NK, (4, 8), (3, 4)):
        if bm * bn > MAX_TILE_ELEMENTS:
            continue
        for once in (False, True) if kernel == "w4" else (False,):
            out.append(Config(bm, bn, bk, warps, stages, once))
    return out


class Weights:
    """Rotated weight copies per shape, quantized both ways, and their dense bf16 originals."""

    def __init__(self, l2_bytes: int, dtype: torch.dtype, copies: int | None = None) -> None:
        from cadence.kernels.formats.quant_formats import quantize_int4, quantize_int8

        self.sets: dict[str, list[dict[str, object]]] = {}
        for name, (k, n) in SHAPES.items():
            made = []
            for _ in range(copies or rotation_sets(n * k / 2, l2_bytes)):
                w = torch.randn(n, k, device=DEVICE) * k**-0.5
                q8, s8 = quantize_int8(w)
                made.append({"dense": w.to(dtype), "w4": quantize_int4(w, 128), "w8": (q8, s8.to(dtype))})
            self.sets[name] = made


def kernel_call(kernel: str, x: torch.Tensor, weight: object, config: Config | None) -> Callable[[], object]:
    """One tiled launch (or the wrapper's default dispatch when config is None)."""
    from cadence.kernels.triton import w4a16, w8a16

    if kernel == "dense":
        return lambda: torch.matmul(x, weight.t())  # type: ignore[attr-defined]
    if kernel == "dequant":
        return lambda: (
            w4a16.w4a16_matmul(x, weight, dequant_min_m=1)  # type: ignore[arg-type]
            if not isinstance(weight, tuple)
            else w8a16.w8a16_matmul(x, *weight, dequant_min_m=1)
        )
    over: dict[str, object] = {} if config is None else asdict(config)
    if kernel == "w4":
        if config is not None:
            over["small_m_threshold"] = 0  # the tiled GEMM even where the GEMV serves
        return lambda: w4a16.w4a16_matmul(x, weight, **over)  # type: ignore[arg-type]
    over.pop("words_once", None)
    return lambda: w8a16.w8a16_matmul(x, *weight, **over)  # type: ignore[misc]


def reference(kernel: str, x: torch.Tensor, weight: object) -> torch.Tensor:
    from cadence.kernels.triton import w4a16, w8a16

    return w4a16.reference(x, weight) if kernel == "w4" else w8a16.reference(x, *weight)  # type: ignore[arg-type,misc]


def run_shapes(
    weights: Weights, kernel: str, m: int, config: Config | None, dtype: torch.dtype, timed: bool
) -> tuple[float, dict[str, float], float]:
    """(µs summed over shapes, µs per shape, worst relative error); µs are 0 when not timed."""
    per_shape, worst = {}, 0.0
    source = {"dequant": "w4"}.get(kernel, kernel)
    for name, (k, _) in SHAPES.items():
        x = torch.randn(m, k, device=DEVICE, dtype=dtype)
        calls = [kernel_call(kernel, x, copy[source], config) for copy in weights.sets[name]]
        if kernel in ("w4", "w8"):
            got = calls[0]()
            ref = reference(kernel, x, weights.sets[name][0][kernel])
            err = ((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-6)).item()
            worst = max(worst, err)
        per_shape[name] = time_us(calls, on_gpu=DEVICE == "cuda") if timed else 0.0
    return sum(per_shape.values()), per_shape, worst


_WORKER: dict[str, object] = {}


def _init_worker(device: str, shapes: dict[str, tuple[int, int]]) -> None:
    global DEVICE, SHAPES
    DEVICE, SHAPES = device, shapes


def _compile(task: tuple[str, int, Config, str]) -> str:
    """Worker: run one configuration once per shape (compiling it); '' or the error."""
    kernel, m, config, dtype_name = task
    if "weights" not in _WORKER:
        import_cadence_from_repo()
        # One copy per shape: fourteen workers each holding the two that timing rotates
        # through ran an 80 GB GPU out of memory.
        _WORKER["weights"] = Weights(0, getattr(torch, dtype_name), copies=1)
    try:
        run_shapes(_WORKER["weights"], kernel, m, config, getattr(torch, dtype_name), timed=False)  # type: ignore[arg-type]
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        return ""
    except Exception as exc:  # noqa: BLE001 - a configuration that fails is reported, not fatal
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def compile_all(tasks: list[tuple[str, int, Config, str]], workers: int) -> dict[tuple[str, int, Config], str]:
    start = time.perf_counter()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=spawn, initializer=_init_worker, initargs=(DEVICE, SHAPES)) as pool:
        errors = list(pool.map(_compile, tasks, chunksize=2))
    print(f"compiled {len(tasks)} configurations in {time.perf_counter() - start:.0f} s", flush=True)
    return {task[:3]: err for task, err in zip(tasks, errors, strict=True) if err}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=[1, 2, 4, 16, 64, 256])
    ap.add_argument("--kernels", nargs="+", choices=["w4", "w8"], default=["w4", "w8"])
    ap.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2))
    ap.add_argument("--budget-s", type=float, default=240.0, help="stop timing new configurations after this")
    ap.add_argument("--out", help="folder for tune_tiled.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, Triton interpreter on CPU")
    args = ap.parse_args(argv)
    global DEVICE, SHAPES
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE, SHAPES, args.dtype, args.workers = "cpu", {"tiny": (256, 64), "small": (128, 32)}, "float16", 2
    elif not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    import_cadence_from_repo()
    dtype = getattr(torch, args.dtype)
    plan = [(kernel, m) for m in args.m for kernel in args.kernels if not (kernel == "w4" and m < 3)]
    tasks = [(kernel, m, c, args.dtype) for kernel, m in plan for c in configs(kernel, m)]
    failed = compile_all(tasks, args.workers) if args.workers else {}
    weights = Weights(torch.cuda.get_device_properties(0).L2_cache_size if DEVICE == "cuda" else 0, dtype)
    name = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    print(f"# tiled GEMM sweep on {name}, {args.dtype}, torch {torch.__version__}")
    print(f"# µs summed over {', '.join(SHAPES)} (K, N = {', '.join(f'{k}x{n}' for k, n in SHAPES.values())})")
    start, results = time.perf_counter(), []
    for kernel, m in plan:
        dense = run_shapes(weights, "dense", m, None, dtype, timed=True)[0]
        default = run_shapes(weights, kernel, m, None, dtype, timed=True)[0]
        dequant = run_shapes(weights, "dequant", m, None, dtype, timed=True)[0] if kernel == "w4" and m >= 64 else 0.0
        rows = []
        for config in configs(kernel, m):
            if (kernel, m, config) in failed:
                rows.append((float("inf"), config, {}, failed[(kernel, m, config)]))
                continue
            if time.perf_counter() - start > args.budget_s:
                break
            total, per_shape, err = run_shapes(weights, kernel, m, config, dtype, timed=True)
            rows.append((total, config, per_shape, "" if err < TOLERANCE else f"rel err {err:.1e}"))
        good = sorted((r for r in rows if not r[3]), key=lambda r: r[0])
        head = f"\n## {kernel} M={m}: dense {dense:.1f} µs, default {default:.1f} ({dense / default:.2f}x)"
        print(head + (f", dequant+mm {dequant:.1f} ({dense / dequant:.2f}x)" if dequant else ""), flush=True)
        for total, config, per_shape, _ in good[:5]:
            shapes = " ".join(f"{name} {us:.1f}" for name, us in per_shape.items())
            print(f"  {config.label():28s} {total:7.1f} µs  {dense / total:.2f}x  ({shapes})", flush=True)
        for _, config, _, why in (r for r in rows if r[3]):
            print(f"  {config.label():28s} failed: {why}", flush=True)
        results.append(
            {
                "kernel": kernel,
                "m": m,
                "dense_us": dense,
                "default_us": default,
                "dequant_us": dequant,
                "configs": [{**asdict(c), "us": t, "per_shape": p, "error": e} for t, c, p, e in rows],
            }
        )
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "tune_tiled.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
