"""W8A16 GEMM: fp16/fp32 activations times a per-output-channel int8 weight.

    out[M, N] = x[M, K] @ (qweight[N, K] * scale[N, None]).T

The weight is read in its nn.Linear layout ``int8 [N, K]`` (see ``quant_formats``):

* ``_w8a16_kernel`` at every decode-sized M: a tiled GEMM that loads ``[BLOCK_K, BLOCK_N]``
  tiles through transposed strides for ``tl.dot``, with the launch from
  ``tile_configs.py``. While M fits one block, K is split across programs (in one launch,
  ``split_k.py``), since N / BLOCK_N tiles alone leave much of a GPU idle. On an H100 it
  beats the elementwise GEMV this file used to have for M <= 2, at M = 1 as well
  (102 against 130 µs over Llama-8B's four projections).
* from ``DEQUANT_MIN_M`` rows (prefill): the whole weight dequantized for the call and a
  dense torch.matmul (``dequant.py``), which rounds the weight to x's dtype once.

Both widen int8 to float exactly (|q| <= 127) and accumulate in fp32. The per-channel
scale is constant along K, so it multiplies the accumulator once at the end.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.triton import split_k
from cadence.kernels.triton.dequant import DEQUANT_MIN_M, int8_to_dense
from cadence.kernels.triton.launch import (
    as_rows,
    check_activations,
    tiled_split_k,
    triton_usable,
)
from cadence.kernels.triton.tile_configs import INVARIANT, w8a16_tile


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


def w8a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    dequant_min_m: int = DEQUANT_MIN_M,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    k_splits: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``x [..., K]`` (fp16/fp32) @ dequant(``qweight int8 [N, K]``, ``scale [N]``).T -> ``[..., N]``.

    Rows below ``dequant_min_m`` take the tiled kernel, more a transient dense weight and
    torch.matmul (``dequant.py``). The tiled kernel splits K into ``k_splits`` slices
    (default: ``launch.tiled_split_k``; 1 turns it off). CPU tensors without
    ``TRITON_INTERPRET=1`` take :func:`reference` (Triton cannot run).
    ``out`` (optional, ``[M, N]`` contiguous, x's dtype) lets callers and tests pre-fill it.
    ``block_*``, ``num_warps`` and ``num_stages`` override the tiled kernel's launch
    (``bench/tune_tiled.py`` sweeps them).
    ``batch_invariant`` runs every M through the tiled kernel with one tile and no
    split, so a row's bits do not depend on the other rows (``kernels/batch_invariant/triton_gemm.py``).
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
    tile = INVARIANT if batch_invariant else w8a16_tile(m)
    if batch_invariant:
        dequant_min_m, k_splits = m + 1, 1
    if m >= dequant_min_m:
        torch.matmul(x2, int8_to_dense(qweight, scale, x2.dtype).t(), out=out)
        return out.reshape(*lead, n)
    bm, bn, bk = block_m or tile.block_m, block_n or tile.block_n, block_k or tile.block_k
    m_blocks, n_blocks, k_tiles = triton.cdiv(m, bm), triton.cdiv(n, bn), triton.cdiv(k, bk)
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
        triton.cdiv(k_tiles, splits) * bk,
        splits,
        x2.stride(0),
        x2.stride(1),
        qweight.stride(0),
        qweight.stride(1),
        out.stride(0),
        out.stride(1),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        FP32_IEEE=x.dtype == torch.float32,
        SPLIT=splits > 1,
        num_warps=num_warps or tile.num_warps,
        num_stages=num_stages or tile.num_stages,
    )
    return out.reshape(*lead, n)
