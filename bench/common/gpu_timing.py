"""GPU timing for bench/gpu_kernels.py and bench/gpu_decode.py: CUDA-graph replays and the ceilings.

Nothing here imports triton at module level: gpu_kernels.py must set TRITON_INTERPRET (CPU
smoke runs) before triton loads.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


def rotation_sets(set_bytes: float, l2_bytes: int, cap: int = 16) -> int:
    """Input sets to cycle through so that together they are 4x the L2 (at least 2).

    do_bench also flushes L2 before each call; rotating keeps the numbers honest with
    graph replays and on any Triton version whose do_bench does not flush.
    """
    return max(2, min(cap, math.ceil(4 * l2_bytes / max(set_bytes, 1.0))))


def cycle_calls(calls: Sequence[Callable[[], object]]) -> Callable[[], object]:
    """One callable that runs the next of `calls` each time (rotation across input sets)."""
    it = itertools.cycle(calls)
    return lambda: next(it)()


def graph_calls(calls: Sequence[Callable[[], object]]) -> list[Callable[[], object]]:
    """Each call captured into its own CUDA graph; the replays drop launch gaps."""
    warm_up(calls)
    graphs = []
    for call in calls:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            call()
        graphs.append(graph)
    return [g.replay for g in graphs]


def time_us(calls: Sequence[Callable[[], object]], on_gpu: bool) -> float:
    """Median µs of one call, cycling through `calls` (one per input set).

    GPU: CUDA-graph replays (`graph_time_us`); a call that cannot be captured (a host
    sync) falls back to triton's do_bench. CPU smoke runs: one pass over the sets with a
    host clock -- interpreter time, only proves the path runs.
    """
    if on_gpu:
        try:
            return graph_time_us(calls)
        except RuntimeError:
            torch.cuda.synchronize()
        import triton.testing

        return float(triton.testing.do_bench(cycle_calls(calls), warmup=25, rep=100, return_mode="median")) * 1e3
    start = time.perf_counter()
    for call in calls:
        call()
    return (time.perf_counter() - start) / len(calls) * 1e6


def graph_time_us(calls: Sequence[Callable[[], object]], min_calls: int = 20, replays: int = 15) -> float:
    """Median µs per call of one CUDA graph holding >= `min_calls` back-to-back calls.

    Why not do_bench: these kernels take 5-100 µs, and timing eager calls measured the
    Python launch path (on an H100, W8A16 tile configurations that a graph found equal
    differed 2-3x, and dense fp16 read 205 µs for 164). The calls cycle through input
    sets that together exceed the L2, so replays read HBM as a decode step does.
    """
    passes = -(-min_calls // len(calls))
    warm_up(calls)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(passes):
            for call in calls:
                call()
    graph.replay()
    return replay_median_ms(graph, replays) * 1e3 / (passes * len(calls))


def warm_up(calls: Sequence[Callable[[], object]]) -> None:
    """Run each call once on a side stream: compiles the kernels outside a capture, as
    torch.cuda.graph requires."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)


def replay_median_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median milliseconds of one replay of `graph`, timed with CUDA events."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


@dataclass
class Ceilings:
    """Measured on the device: what 100% means in the tables."""

    copy_gbps: float  # device-to-device copy, bytes read + written
    tflops: dict[str, float]  # dtype name -> dense matmul rate
    repeat_spread_pct: float = 0.0  # the copy timed twice: differences below this are noise


def measure_ceilings(device: str, smoke: bool) -> Ceilings:
    """A large copy and large fp16/bf16(/fp8) matmuls on fresh random data (never zeros)."""
    on_gpu = device == "cuda"
    n = (1 << 20) if smoke else (1 << 29)  # 1 GiB of fp16 each way on the GPU: far past any cache
    size = 256 if smoke else 8192
    rates = {
        name: matmul_rate(device, dtype, size) for name, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16))
    }
    fp8 = fp8_matmul_rate(size) if on_gpu else None
    if fp8:
        rates["fp8"] = fp8
    first, again = copy_rate(device, n), copy_rate(device, n)
    return Ceilings(copy_gbps=first, tflops=rates, repeat_spread_pct=100 * abs(again - first) / first)


def copy_rate(device: str, n: int) -> float:
    """GB/s of an n-element fp16 device-to-device copy, counting bytes read plus written."""
    src = torch.randn(n, device=device, dtype=torch.float16)
    dst = torch.empty_like(src)
    return 2 * n * 2 / time_us([lambda: dst.copy_(src)], device == "cuda") / 1e3


def matmul_rate(device: str, dtype: torch.dtype, size: int) -> float:
    """TFLOP/s of a size^3 torch matmul."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return 2 * size**3 / time_us([lambda: torch.mm(a, b)], device == "cuda") / 1e6


def fp8_matmul_rate(size: int) -> float | None:
    """TFLOP/s of an fp8 e4m3 torch._scaled_mm (fp32 accumulation), or None where there is none."""
    if torch.cuda.get_device_capability() < (8, 9) or not hasattr(torch, "_scaled_mm"):
        return None
    try:
        a = torch.randn(size, size, device="cuda", dtype=torch.float16).to(torch.float8_e4m3fn)
        b = torch.randn(size, size, device="cuda", dtype=torch.float16).to(torch.float8_e4m3fn).t()  # column-major
        one = torch.ones((), device="cuda")
        mm_us = time_us([lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)], True)
    except (RuntimeError, TypeError) as exc:
        print(f"fp8 matmul ceiling not measured: {exc}")
        return None
    return 2 * size**3 / mm_us / 1e6
