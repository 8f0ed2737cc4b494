"""Every Triton kernel, in the configurations its wrapper picks, compiles for A100 and H100.

No GPU is needed: the launches are recorded in the interpreter (tests/support/triton_aot.py) and
compiled to cubins for sm_80 and sm_90a by Triton's NVIDIA backend in a subprocess. This
catches what the interpreter cannot: bf16 and fp8 paths, ``tl.dot`` layout rules and
anything else only the real compiler rejects. Register spills are reported, not failed:
they cost speed, which is for bench/ to judge on a GPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from functools import partial

import pytest
import torch

from cadence.kernels.batch_invariant import triton_gemm
from cadence.kernels.formats.fp8_format import quantize_fp8_weight
from cadence.kernels.formats.quant_formats import Int4Weight, quantize_int4, quantize_int8
from cadence.kernels.triton import (
    dequant,
    fused_moe,
    kv_cache_write,
    paged_attention,
    rms_norm,
    rotary,
    silu_and_mul,
    w4a16,
    w8a8_fp8,
    w8a16,
)
from tests.support.triton_aot import Launch, dump_launches, record_launches

# The launches are recorded by running the wrappers on CPU tensors in the interpreter. A
# machine with a GPU does not turn the interpreter on (conftest.py); there the kernel
# tests compile and run every kernel for real, so this check is for machines without one.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels for real"),
]

pytest.importorskip("triton.backends.nvidia.compiler")

ARCHS = (80, 90)
HALF = (torch.float16, torch.bfloat16)


def quant_cases() -> dict[str, Callable[[], object]]:
    k, n = 512, 384
    w = torch.randn(n, k)
    q8, s8 = quantize_int8(w)
    wq, ws = quantize_fp8_weight(w)
    sym = quantize_int4(w, 128, symmetric=True)
    asym = quantize_int4(w, 32, symmetric=False)
    assert asym.zeros is not None
    float_zeros = Int4Weight(asym.qweight, asym.scales.half(), asym.zeros.float(), 32)  # GGUF Q4_1
    cases: dict[str, Callable[[], object]] = {}
    long_q8, long_s8 = quantize_int8(torch.randn(n, 4096))  # a K long enough to split
    cases["w8a16 split-K float16 M=1"] = lambda: w8a16.w8a16_matmul(
        torch.randn(1, 4096, dtype=torch.float16), long_q8, long_s8.half()
    )
    long_asym = quantize_int4(torch.randn(n, 4096), 32, symmetric=False)
    x16 = torch.randn(16, 4096, dtype=torch.float16)  # the tiled kernels' split-K variant
    cases["w8a16 tiled split-K float16 M=16"] = lambda: w8a16.w8a16_matmul(x16, long_q8, long_s8.half(), k_splits=4)
    cases["w4a16 g32 zeros tiled split-K float16 M=16"] = lambda: w4a16.w4a16_matmul(x16, long_asym, k_splits=4)
    for dtype in HALF:  # the large-M path's whole-weight dequantize
        cases[f"dequant int4 g32 zeros {str(dtype)[6:]}"] = partial(dequant.int4_to_dense, asym, dtype)
        cases[f"dequant int4 g128 sym {str(dtype)[6:]}"] = partial(dequant.int4_to_dense, sym, dtype)
        cases[f"dequant int8 {str(dtype)[6:]}"] = partial(dequant.int8_to_dense, q8, s8, dtype)
    for dtype in (*HALF, torch.float32):
        for m in (1, 64):
            x = torch.randn(m, k, dtype=dtype)
            name = f"{str(dtype)[6:]} M={m}"
            cases[f"w8a16 {name}"] = partial(w8a16.w8a16_matmul, x, q8, s8.to(dtype))
            cases[f"fp8 triton {name}"] = partial(w8a8_fp8.fp8_matmul, x, wq, ws, allow_scaled_mm=False)
            if dtype in HALF:
                for wname, weight in (("g128 sym", sym), ("g32 zeros", asym), ("g32 float zeros", float_zeros)):
                    cases[f"w4a16 {wname} {name}"] = partial(w4a16.w4a16_matmul, x, weight)
        # --batch-invariant: one configuration for every M, so M = 1 stands for all.
        x, name = torch.randn(1, k, dtype=dtype), f"{str(dtype)[6:]} M=1"
        dense, bias = w.to(dtype), torch.randn(n, dtype=dtype)
        cases[f"invariant dense {name}"] = partial(triton_gemm.batch_invariant_linear, x, dense, bias)
        cases[f"invariant w8a16 {name}"] = partial(w8a16.w8a16_matmul, x, q8, s8.to(dtype), batch_invariant=True)
        cases[f"invariant fp8 {name}"] = partial(w8a8_fp8.fp8_matmul, x, wq, ws, batch_invariant=True)
        if dtype in HALF:
            cases[f"invariant w4a16 g128 sym {name}"] = partial(w4a16.w4a16_matmul, x, sym, batch_invariant=True)
    return cases


def attention_cases() -> dict[str, Callable[[], object]]:
    """Llama-8B heads (32/8, head_dim 128) and SmolLM2's (9/3, head_dim 64: a group of 3)."""
    cases: dict[str, Callable[[], object]] = {}
    block, blocks_per_seq = 16, 8
    num_blocks = 2 * blocks_per_seq
    tables = torch.arange(num_blocks, dtype=torch.int32).reshape(2, blocks_per_seq)
    seq_lens = torch.tensor([100, 128], dtype=torch.int32)
    for heads, kv_heads, head_dim in ((32, 8, 128), (9, 3, 64)):
        for cache_dtype in (*HALF, torch.int8, torch.float8_e4m3fn):
            dtype = torch.bfloat16 if cache_dtype == torch.bfloat16 else torch.float16
            cache = torch.zeros(2, num_blocks, block, kv_heads, head_dim, dtype=cache_dtype)
            quantized = cache_dtype in (torch.int8, torch.float8_e4m3fn)
            scales = torch.ones(2, num_blocks, block, kv_heads) if quantized else None
            tag = f"{heads}/{kv_heads}x{head_dim} {str(cache_dtype)[6:]}"

            def run(
                query_lens: list[int],
                splits: int | None,
                window: int | None,
                dtype: torch.dtype = dtype,
                cache: torch.Tensor = cache,
                scales: torch.Tensor | None = scales,
                heads: int = heads,
                head_dim: int = head_dim,
                batch_invariant: bool = False,
            ) -> object:
                starts = torch.tensor([0, query_lens[0], sum(query_lens)], dtype=torch.int32)
                q = torch.randn(sum(query_lens), heads, head_dim, dtype=dtype)
                return paged_attention.paged_attention(
                    q,
                    cache,
                    tables,
                    seq_lens,
                    starts,
                    max(query_lens),
                    head_dim**-0.5,
                    window,
                    splits,
                    max_seq_len=128,
                    num_sms=132,
                    kv_scales=scales,
                    batch_invariant=batch_invariant,
                )

            cases[f"attention decode {tag}"] = partial(run, [1, 1], 1, None)
            cases[f"attention decode invariant {tag}"] = partial(run, [1, 1], None, None, batch_invariant=True)
            cases[f"attention decode split {tag}"] = partial(run, [1, 1], 4, None)
            cases[f"attention prefill+decode window {tag}"] = partial(run, [37, 1], None, 64)
            k = torch.randn(5, kv_heads, head_dim, dtype=dtype)
            cases[f"kv write {tag}"] = partial(
                kv_cache_write.write_kv_cache, k, k, cache, torch.tensor([0, 1, 2, 17, 40]), scales
            )
    return cases


def moe_cases() -> dict[str, Callable[[], object]]:
    experts, top_k, hidden, inter = 8, 2, 256, 128
    dense_w1, dense_w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    formats: dict[str, tuple[fused_moe.ExpertWeights, fused_moe.ExpertWeights]] = {
        "int8": (fused_moe.Int8Experts.quantize(dense_w1), fused_moe.Int8Experts.quantize(dense_w2)),
        "int4": (fused_moe.Int4Experts.quantize(dense_w1, 64, False), fused_moe.Int4Experts.quantize(dense_w2, 64)),
    }
    cases: dict[str, Callable[[], object]] = {}
    for dtype in HALF:
        for m in (1, 64):
            x = torch.randn(m, hidden, dtype=dtype)
            weights, ids = fused_moe.route(torch.randn(m, experts), top_k, renormalize=True)
            all_formats: dict[str, tuple[fused_moe.ExpertWeights, fused_moe.ExpertWeights]] = {
                "dense": (dense_w1.to(dtype), dense_w2.to(dtype)),
                **formats,
            }
            for fmt, (w1, w2) in all_formats.items():
                cases[f"moe {fmt} {str(dtype)[6:]} M={m}"] = partial(fused_moe.fused_moe, x, w1, w2, weights, ids)
    return cases


def layer_op_cases() -> dict[str, Callable[[], object]]:
    """Llama-8B's widths: hidden 4096, 32/8 heads of 128, intermediate 14336."""
    cases: dict[str, Callable[[], object]] = {}
    angles = torch.rand(64, 64)
    for dtype in (*HALF, torch.float32):
        x, weight = torch.randn(3, 4096, dtype=dtype), torch.ones(4096, dtype=dtype)
        qkv = torch.randn(3, 48 * 128, dtype=dtype)
        q, k = qkv[:, : 32 * 128].view(3, 32, 128), qkv[:, 32 * 128 : 40 * 128].view(3, 8, 128)
        name = str(dtype)[6:]
        cases[f"rms_norm {name}"] = partial(rms_norm.rms_norm, x, weight, 1e-5)
        cases[f"rms_norm residual {name}"] = partial(rms_norm.rms_norm, x, weight, 1e-5, x)
        cases[f"rotary {name}"] = partial(
            rotary.apply_rotary, torch.tensor([0, 5, 9]), q, k, angles.cos(), angles.sin()
        )
        cases[f"silu_and_mul {name}"] = partial(silu_and_mul.silu_and_mul, torch.randn(3, 2 * 14336, dtype=dtype))
    return cases


@pytest.fixture(scope="module")
def compiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Launch], list[dict]]:
    launches = record_launches({**quant_cases(), **attention_cases(), **moe_cases(), **layer_op_cases()})
    for launch in launches:
        if "ASM" in launch.constexprs:  # recorded in the interpreter, which cannot run inline PTX
            launch.constexprs["ASM"] = True
    path = str(tmp_path_factory.mktemp("aot") / "launches.json")
    dump_launches(launches, path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "support", "triton_aot.py")
    proc = subprocess.run(
        [sys.executable, script, path, "--arch", *map(str, ARCHS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return launches, json.loads(proc.stdout)


def test_every_wrapper_launch_was_recorded(compiled: tuple[list[Launch], list[dict]]) -> None:
    launches, _ = compiled
    kernels = {launch.kernel for launch in launches}
    assert kernels == {
        "_batch_invariant_gemm_kernel",
        "_w8a16_kernel",
        "_w4a16_gemv_kernel",
        "_w4a16_gemm_kernel",
        "_w8a8_fp8_kernel",
        "_attention_kernel",
        "_merge_kernel",
        "_write_kernel",
        "_moe_gemm_kernel",
        "_rms_norm_kernel",
        "_rotary_kernel",
        "_silu_and_mul_kernel",
        "_int4_to_dense_kernel",
        "_int8_to_dense_kernel",
    }


def test_every_launch_compiles_for_a100_and_h100(compiled: tuple[list[Launch], list[dict]]) -> None:
    _, results = compiled
    print(f"\n{'launch':58} {'kernel':22} arch  regs  spill  smem")
    for r in results:
        status = (
            r.get("error", "")[:60]
            or r.get("skipped")
            or f"{r['registers']:4d} {r['spill_stores']:6d} {r['shared_bytes']:6d}"
        )
        print(f"{r['label'][:58]:58} {r['kernel'][:22]:22} {r['arch']:4d} {status}")
    failures = [f"{r['label']} on sm_{r['arch']}: {r['error']}" for r in results if "error" in r]
    assert not failures, "\n".join(failures)


def test_only_the_fp8_cache_write_needs_fp8_hardware(compiled: tuple[list[Launch], list[dict]]) -> None:
    """Everything else reads fp8 as bytes; an fp8 cache on an A100 is written in torch."""
    launches, _ = compiled
    needs_fp8 = {(launch.kernel, launch.label) for launch in launches if launch.min_arch > 80}
    assert needs_fp8 and {kernel for kernel, _ in needs_fp8} == {"_write_kernel"}
    assert all("float8" in label for _, label in needs_fp8)
