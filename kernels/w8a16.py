"""W8A16 GEMM: fp16/fp32 activations times a per-output-channel int8 weight.

    out[M, N] = x[M, K] @ (qweight[N, K] * scale[N, None]).T

The weight is read in its nn.Linear layout ``int8 [N, K]`` (see ``quant_formats``). Two
kernels:

* ``_w8a16_gemv_kernel`` for decode-sized M (<= ``DEFAULT_SMALL_M_THRESHOLD``, 2): each
  program streams BLOCK_N whole weight rows along K, contiguous bytes, with products
  accumulated elementwise and reduced once at the end; K is split across programs (in
  one launch, ``split_k.py``) until the GPU has several programs per SM, since a GEMV is
  won by keeping many loads in flight.
* ``_w8a16_kernel`` above that: a tiled GEMM that loads ``[BLOCK_K, BLOCK_N]`` tiles
  through transposed strides for ``tl.dot``. While M fits one block, K is split across
  programs as for the GEMV, since N / BLOCK_N tiles alone leave much of a GPU idle.
* from ``DEQUANT_MIN_M`` rows (prefill): the whole weight dequantized for the call and a
  dense torch.matmul (``dequant.py``), which rounds the weight to x's dtype once.

Both widen int8 to float exactly (|q| <= 127) and accumulate in fp32. The per-channel
scale is constant along K, so it multiplies the accumulator once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels import split_k
from cadence.kernels.batch_invariant_gemm import BLOCK_M as INVARIANT_BLOCK_M
from cadence.kernels.dequant import DEQUANT_MIN_M, int8_to_dense
from cadence.kernels.launch import (
    GEMV_PROGRAMS_PER_SM,
    as_rows,
    check_activations,
    num_sms,
    split_k_to_fill,
    tiled_split_k,
    triton_usable,
)

# Rows up to this many take the GEMV kernel. On an H100 (Llama-8B's four projections,
# bf16) the GEMV still beats the tiled kernel at M = 2; by M = 4 its [M, N, K]
# accumulator makes it the slower one (bench/RESULTS.md).
DEFAULT_SMALL_M_THRESHOLD = 2


def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Plain-torch W8A16: dequantize in fp32, matmul in fp32, cast to x's dtype."""
    w = qweight.float() * scale.float()[:, None]
    return (x.float() @ w.t()).to(x.dtype)


@triton.jit
def _w8a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Program (m, n, s) multiplies K slice s of a [BLOCK_M, BLOCK_N] output tile; with
    SPLIT (one M block only) the slices meet in ``split_k.store_tile``."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + (k_start + offs_k)[None, :] * stride_xk
    # [BLOCK_K, BLOCK_N] view of the [N, K] weight: no transpose copy in memory.
    w_ptrs = w_ptr + (k_start + offs_k)[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):
        mask_k = (k0 + offs_k) < k_stop
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        w = w.to(x.dtype)
        if FP32_IEEE:
            # fp32 activations ask for fp32 accuracy; the default would be TF32 on GPUs.
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    split_k.store_tile(
        acc,
        ws_ptr,
        counter_ptr,
        out_ptr,
        stride_om,
        stride_on,
        pid_k,
        pid_n,
        offs_m,
        offs_n,
        mask_m,
        mask_n,
        M,
        N,
        num_splits,
        BLOCK_M,
        BLOCK_N,
        SPLIT,
    )


@triton.jit
def _w8a16_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    M,
    N,
    K,
    k_per_split,
    num_splits,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Program (n, s) sums K slice s of BLOCK_N output channels for every row (M <= BLOCK_M)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_start = pid_k * k_per_split
    k_stop = tl.minimum(k_start + k_per_split, K)
    for k0 in range(k_start, k_stop, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < k_stop
        # Row n's bytes are contiguous along K: wide, coalesced loads.
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0
        ).to(tl.float32)
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        ).to(tl.float32)
        acc += x[:, None, :] * w[None, :, :]
    scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    result = tl.sum(acc, axis=2) * scale[None, :]
    out_mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tl.store(ws_ptr + (pid_k * M + offs_m[:, None]) * N + offs_n[None, :], result, mask=out_mask)
        split_k.finish(
            ws_ptr, counter_ptr, out_ptr, stride_om, pid_n, offs_n, mask_n, M, N, num_splits, BLOCK_M, BLOCK_N
        )
    else:
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=out_mask)


def w8a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    small_m_threshold: int = DEFAULT_SMALL_M_THRESHOLD,
    dequant_min_m: int = DEQUANT_MIN_M,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    gemv_block_n: int = 16,
    gemv_block_k: int = 256,
    k_splits: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``x [..., K]`` (fp16/fp32) @ dequant(``qweight int8 [N, K]``, ``scale [N]``).T -> ``[..., N]``.

    Rows M <= ``small_m_threshold`` take the GEMV, more the tiled kernel, and from
    ``dequant_min_m`` a transient dense weight and torch.matmul (``dequant.py``). The
    tiled kernel splits K into ``k_splits`` slices (default: ``launch.tiled_split_k``;
    1 turns it off; the GEMV and dequantize paths choose their own). CPU tensors without
    ``TRITON_INTERPRET=1`` take :func:`reference` (Triton cannot run).
    ``out`` (optional, ``[M, N]`` contiguous, x's dtype) lets callers and tests pre-fill it.
    ``batch_invariant`` runs every M through the tiled kernel with one M tile and no
    split, so a row's bits do not depend on the other rows (``batch_invariant_gemm.py``).
    """
    n, k = qweight.shape
    if x.shape[-1] != k or scale.shape != (n,):
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scale {tuple(scale.shape)}"
        )
    check_activations(x)
    x2, out, lead = as_rows(x, n, out)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, n)
    if not triton_usable(x):
        out.copy_(reference(x2, qweight, scale))
        return out.reshape(*lead, n)
    if batch_invariant:
        small_m_threshold, dequant_min_m, block_m, k_splits = 0, m + 1, INVARIANT_BLOCK_M, 1
    if m >= dequant_min_m:
        torch.matmul(x2, int8_to_dense(qweight, scale, x2.dtype).t(), out=out)
        return out.reshape(*lead, n)
    # tl.dot needs every block dim >= 16; larger M tiles only when there are rows to fill.
    if m <= small_m_threshold and qweight.stride(1) == 1:
        _gemv(x2, qweight, scale, out, gemv_block_n, gemv_block_k)
        return out.reshape(*lead, n)
    bm = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    m_blocks, n_blocks, k_tiles = triton.cdiv(m, bm), triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    splits = tiled_split_k(m, m_blocks, n_blocks, k_tiles, k, out, k_splits)
    _w8a16_kernel[(m_blocks, n_blocks, splits)](
        x2,
        qweight,
        scale,
        out,
        split_k.workspace(splits, m, n, n_blocks, out),
        split_k.counters(x2.device),
        m,
        n,
        k,
        triton.cdiv(k_tiles, splits) * block_k,
        splits,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        FP32_IEEE=x.dtype == torch.float32,
        SPLIT=splits > 1,
    )
    return out.reshape(*lead, n)


def _gemv(
    x2: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, out: torch.Tensor, block_n: int, block_k: int
) -> None:
    m, k = x2.shape
    n = qweight.shape[0]
    block_k = min(block_k, triton.next_power_of_2(k))
    k_tiles = triton.cdiv(k, block_k)
    n_blocks = triton.cdiv(n, block_n)
    splits = split_k_to_fill(n_blocks, k_tiles, num_sms(x2.device), GEMV_PROGRAMS_PER_SM)
    k_per_split = triton.cdiv(k_tiles, splits) * block_k
    assert out.stride(1) == 1
    _w8a16_gemv_kernel[(n_blocks, splits)](
        x2,
        qweight,
        scale,
        out,
        split_k.workspace(splits, m, n, n_blocks, out),
        split_k.counters(x2.device),
        m,
        n,
        k,
        k_per_split,
        splits,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        out.stride(0),
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT=splits > 1,
    )
