"""A whole int8 / int4 weight to a dense matrix in one pass: the large-M path of W8A16/W4A16.

At prefill-sized M a weight-only GEMM is compute-bound: the weight bytes it saves are a
small share of the time, and our tiled Triton kernels ran well below the dense fp16
matmul at M = 64-256 on a GPU (``git show 90ba143:bench/HISTORY.md``). So from ``DEQUANT_MIN_M`` rows,
``w8a16_matmul`` and ``w4a16_matmul`` dequantize the weight into a transient dense
matrix and hand it to torch.matmul (cuBLAS), as vLLM's AWQ layer does from 256 tokens.
The dense copy lives for that one call, so the memory saving of the quantized weight
stands; the pass reads the packed weight once and writes two bytes per weight.

Rounding matches ``quant_formats``: the value is formed in fp32, where it is exact, and
rounded once to the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.formats.quant_formats import SYMMETRIC_ZERO, Int4Weight, dequantize_int4

# Rows from which the wrappers take this path. Decode batches stay below it (CUDA graphs
# capture at most 256 rows, and a transient weight inside a graph would pin its memory);
# prefill chunks (typically 512-8192 tokens) take it. Not yet tuned on a GPU: bench/gpu_kernels.py
# times both paths from M = 256.
DEQUANT_MIN_M = 512
BLOCK_N = 128
BLOCK_K_WORDS = 8  # int4: packed rows per program, 64 weights along K
BLOCK_K = 64  # int8: weights along K per program
NUM_WARPS = 8  # int8: 32 weights a thread (4 warps held 64 in 176-192 registers)


@triton.jit
def _int4_to_dense_kernel(
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    K_WORDS,
    N,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SYM_ZERO: tl.constexpr,
    BLOCK_KW: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """qweight int32 [K // 8, N] (nibble s of word w is row 8w + s) -> out [K, N]."""
    offs_w = tl.program_id(0) * BLOCK_KW + tl.arange(0, BLOCK_KW)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_w[:, None] < K_WORDS) & (offs_n[None, :] < N)
    words = tl.load(qw_ptr + offs_w[:, None] * N + offs_n[None, :], mask=mask, other=0)
    for s in tl.static_range(8):
        rows = offs_w * 8 + s
        at = (rows // GROUP)[:, None] * N + offs_n[None, :]
        scale = tl.load(s_ptr + at, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(z_ptr + at, mask=mask, other=0).to(tl.float32)
        else:
            zero = SYM_ZERO
        code = ((words >> (4 * s)) & 0xF).to(tl.float32)
        value = (code - zero) * scale  # exact in fp32: <= 5 significant bits times the scale
        tl.store(out_ptr + rows[:, None] * N + offs_n[None, :], value.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_to_dense_kernel(
    q_ptr, s_ptr, out_ptr, N, K, stride_qn, stride_qk, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr
):
    """qweight int8 [N, K] times scale [N] -> out [N, K] (contiguous)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    q = tl.load(q_ptr + offs_n[:, None] * stride_qn + offs_k[None, :] * stride_qk, mask=mask, other=0)
    scale = tl.load(s_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)
    value = q.to(tl.float32) * scale[:, None]  # exact in fp32: 8 bits times the scale
    tl.store(out_ptr + offs_n[:, None] * K + offs_k[None, :], value.to(out_ptr.dtype.element_ty), mask=mask)


def int4_to_dense(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[K, N]`` weight (the matmul's right operand) in ``dtype``."""
    k, n = weight.in_features, weight.out_features
    qweight, scales = weight.qweight.contiguous(), weight.scales.contiguous()
    zeros = weight.zeros.contiguous() if weight.zeros is not None else scales  # dummy pointer, never read
    out = torch.empty(k, n, device=qweight.device, dtype=dtype)
    grid = (triton.cdiv(k // 8, BLOCK_K_WORDS), triton.cdiv(n, BLOCK_N))
    _int4_to_dense_kernel[grid](
        qweight,
        scales,
        zeros,
        out,
        k // 8,
        n,
        GROUP=weight.group_size,
        HAS_ZEROS=weight.zeros is not None,
        SYM_ZERO=SYMMETRIC_ZERO,
        BLOCK_KW=BLOCK_K_WORDS,
        BLOCK_N=BLOCK_N,
    )
    return out


def int8_to_dense(qweight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``[N, K]`` (nn.Linear layout) weight in ``dtype``."""
    n, k = qweight.shape
    out = torch.empty(n, k, device=qweight.device, dtype=dtype)
    grid = (triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K))
    _int8_to_dense_kernel[grid](
        qweight,
        scale.contiguous(),
        out,
        n,
        k,
        qweight.stride(0),
        qweight.stride(1),
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS,
    )
    return out


def reference_int4(weight: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """What ``int4_to_dense`` computes, in plain torch (for int8, ``quant_formats.dequantize_int8``)."""
    return dequantize_int4(weight, dtype).t()
