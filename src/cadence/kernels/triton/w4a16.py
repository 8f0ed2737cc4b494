"""W4A16 GEMM: fp16/fp32 activations times a group-wise int4 weight (``Int4Weight``).

    out[M, N] = x[M, K] @ W[K, N],  W[k, n] = (code[k, n] - zero[k // g, n]) * scale[k // g, n]

Two kernels over the one layout in ``quant_formats`` (qweight int32 [K // 8, N], packed
along K):

* ``w4a16_gemv.py`` for decode-sized M (<= ``small_m_threshold``: 2 by default, at most
  4): every row against each weight byte read once, bandwidth-bound (see there).
* ``_w4a16_gemm_kernel`` above that: a classic tiled GEMM with ``tl.dot``, launched as
  ``tile_configs.py`` says. It picks BLOCK_K dividing the group size, so a K tile lies in
  one group and the scale (and zero) is a single ``[BLOCK_N]`` vector load per tile. Each
  packed int32 is loaded once and its nibbles spread along K in registers. Weights are
  dequantized to the activation dtype (rounding once, as the reference does) and
  accumulated in fp32. While M fits one block, K is split across programs
  (``split_k.py``) to fill the GPU.
* from ``DEQUANT_MIN_M`` rows (prefill): the whole weight dequantized for the call and
  a dense torch.matmul (``dequant.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.formats.quant_formats import SYMMETRIC_ZERO, Int4Weight, dequantize_int4
from cadence.kernels.triton import split_k
from cadence.kernels.triton.dequant import DEQUANT_MIN_M, int4_to_dense
from cadence.kernels.triton.launch import as_rows, check_activations, num_sms, tiled_split_k, triton_usable
from cadence.kernels.triton.tile_configs import INVARIANT, w4a16_tile
from cadence.kernels.triton.w4a16_gemv import GEMV_MAX_M, w4a16_gemv
from cadence.kernels.triton.w4a16_gemv import supports as gemv_supports

# On an H100 (Llama-8B's four projections, bf16, CUDA-graph replays) the GEMV took 112 µs
# at M = 2 and 135 at M = 3, and the tuned tiled GEMM 121 at M = 4 (tile_configs.py), about
# the same at any M it serves up to 16: the GEMV keeps M <= 2.
DEFAULT_SMALL_M_THRESHOLD = min(2, GEMV_MAX_M)


def reference(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """Plain-torch W4A16: dequantize to x's dtype (one rounding), matmul in fp32."""
    w = dequantize_int4(weight, dtype=x.dtype).float()  # [N, K]
    return (x.float() @ w.t()).to(x.dtype)


@triton.jit
def _dequant_tile(
    qw_ptr,
    s_ptr,
    z_ptr,
    k0,
    offs_k,
    offs_n,
    mask_n,
    N,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SYM_ZERO: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WORDS_ONCE: tl.constexpr,
):
    """Dequantize rows ``k0 + offs_k`` x columns ``offs_n`` (fp32 [BLOCK_K, BLOCK_N]).

    qweight, scales and zeros are contiguous (row stride N), checked by the wrapper.
    WORDS_ONCE loads each int32 once and spreads its eight nibbles along K in registers;
    otherwise each of the eight k sharing a word loads it again (the same cache line).
    """
    if WORDS_ONCE:
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(qw_ptr + words[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        shifts = tl.arange(0, 8) * 4
        codes = tl.reshape((packed[:, None, :] >> shifts[None, :, None]) & 0xF, (BLOCK_K, BLOCK_N))
    else:
        kk = k0 + offs_k
        packed = tl.load(qw_ptr + (kk // 8)[:, None] * N + offs_n[None, :], mask=mask_n[None, :], other=0)
        codes = (packed >> ((kk % 8) * 4)[:, None]) & 0xF
    g = k0 // GROUP  # the whole tile is in one group (BLOCK_K divides GROUP)
    scale = tl.load(s_ptr + g * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        # uint8 zero points (GPTQ/AWQ/ours) or real-valued ones (GGUF Q4_1's -min/scale):
        # in fp32 either way, which is exact for the integer ones.
        zero = tl.load(z_ptr + g * N + offs_n, mask=mask_n, other=0).to(tl.float32)
        q = codes.to(tl.float32) - zero[None, :]
    else:
        q = (codes - SYM_ZERO).to(tl.float32)
    return q * scale[None, :]


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
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
    stride_om,
    stride_on,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SYM_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    SPLIT: tl.constexpr,
    WORDS_ONCE: tl.constexpr,
):
    """Program (m, n, s) multiplies K slice s (whole BLOCK_K tiles) of a [BLOCK_M, BLOCK_N]
    output tile; with SPLIT (one M block only) the slices meet in ``split_k.store_tile``."""
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_start, k_stop, BLOCK_K):  # K % BLOCK_K == 0: no K mask needed
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :] * stride_xk, mask=mask_m[:, None], other=0.0
        )
        w = _dequant_tile(
            qw_ptr,
            s_ptr,
            z_ptr,
            k0,
            offs_k,
            offs_n,
            mask_n,
            N,
            GROUP,
            HAS_ZEROS,
            SYM_ZERO,
            BLOCK_K,
            BLOCK_N,
            WORDS_ONCE,
        )
        w = w.to(x.dtype)
        if FP32_IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")  # not TF32 for fp32 inputs
        else:
            acc = tl.dot(x, w, acc)
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


def _block_k_for(group_size: int, cap: int = 64) -> int:
    """Largest power of two <= cap dividing group_size (so a K tile never spans groups)."""
    b = cap
    while group_size % b:
        b //= 2
    return b


def w4a16_matmul(
    x: torch.Tensor,
    weight: Int4Weight,
    out: torch.Tensor | None = None,
    *,
    small_m_threshold: int = DEFAULT_SMALL_M_THRESHOLD,
    dequant_min_m: int = DEQUANT_MIN_M,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    words_once: bool = True,
    k_splits: int | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``x [..., K]`` (fp16/fp32) @ dequant(weight).T -> ``[..., N]`` in x's dtype.

    Rows M <= ``small_m_threshold`` take the GEMV kernel, more take the tiled GEMM, and
    from ``dequant_min_m`` a transient dense weight and torch.matmul (``dequant.py``). The
    tiled GEMM splits K into ``k_splits`` slices (default: ``launch.tiled_split_k``; 1
    turns it off; the GEMV and dequantize paths choose their own). CPU tensors without
    ``TRITON_INTERPRET=1`` take :func:`reference`. ``out`` (optional, ``[M, N]``, x's
    dtype) lets tests pre-fill it with NaN to catch unwritten elements. ``block_m``,
    ``block_n``, ``block_k`` (capped by the group size), ``num_warps``, ``num_stages`` and
    ``words_once`` override the tiled GEMM's launch (``bench/tune_tiled.py`` sweeps them).
    ``batch_invariant``
    runs every M through the tiled GEMM with one M tile and no split, so a row's bits do not
    depend on the other rows (``kernels/batch_invariant/triton_gemm.py``).
    """
    k, n, group = weight.in_features, weight.out_features, weight.group_size
    if x.shape[-1] != k:
        raise ValueError(f"x has K={x.shape[-1]}, weight has K={k}")
    if k % group or weight.scales.shape != (k // group, n):
        raise ValueError(f"scales {tuple(weight.scales.shape)} do not fit K={k}, N={n}, group={group}")
    check_activations(x)
    x2, out, lead = as_rows(x, n, out)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, n)
    if not triton_usable(x):
        out.copy_(reference(x2, weight))
        return out.reshape(*lead, n)

    if batch_invariant:
        small_m_threshold, dequant_min_m, k_splits = 0, m + 1, 1
    if m >= dequant_min_m:
        torch.matmul(x2, int4_to_dense(weight, x2.dtype), out=out)
        return out.reshape(*lead, n)
    # The kernels index qweight/scales/zeros with row stride N.
    qweight = weight.qweight.contiguous()
    scales = weight.scales.contiguous()
    zeros = None if weight.zeros is None else weight.zeros.contiguous()
    common = dict(GROUP=group, HAS_ZEROS=zeros is not None, SYM_ZERO=SYMMETRIC_ZERO)
    if m <= small_m_threshold and gemv_supports(x2, weight):
        contiguous = Int4Weight(qweight, scales, zeros, group)
        w4a16_gemv(x2, contiguous, out, num_sms(x.device))
    else:
        tile = INVARIANT if batch_invariant else w4a16_tile(m)
        bk = _block_k_for(group, block_k or tile.block_k)
        if bk < 16:
            raise ValueError(f"group_size {group} must be a multiple of 16 for the tiled kernel")
        bm, bn = block_m or tile.block_m, block_n or tile.block_n
        m_blocks, n_blocks = triton.cdiv(m, bm), triton.cdiv(n, bn)
        splits = tiled_split_k(m, m_blocks, n_blocks, k // bk, k // 2, out, k_splits)
        _w4a16_gemm_kernel[(m_blocks, n_blocks, splits)](
            x2,
            qweight,
            scales,
            scales if zeros is None else zeros,  # scales: a dummy pointer, never read
            out,
            split_k.workspace(splits, m, n, n_blocks, out),
            split_k.counters(x2.device),
            m,
            n,
            k,
            triton.cdiv(k // bk, splits) * bk,
            splits,
            x2.stride(0),
            x2.stride(1),
            out.stride(0),
            out.stride(1),
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            FP32_IEEE=x.dtype == torch.float32,
            SPLIT=splits > 1,
            WORDS_ONCE=words_once,
            num_warps=num_warps or tile.num_warps,
            num_stages=num_stages or tile.num_stages,
            **common,
        )
    return out.reshape(*lead, n)
