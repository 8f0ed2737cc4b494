"""W4A16 GEMV for decode-sized batches (M <= 4) over the ``[K // 8, N]`` int4 layout.

A decode step reads every weight once for a handful of rows, so the kernel's job is to
keep HBM busy. What that took on an H100 (bench/RESULTS.md has the sweep):

* **Big tiles, pipelined.** Each step loads a ``[BLOCK_K / 8, BLOCK_N]`` block of packed
  words (8 KB at 128 x 128) through ``tl.range(num_stages=3)``'s async copies, and the
  2-byte scale row is loaded one step ahead in registers (async copies skip it, and
  waiting for it each step cost a full memory round trip).
* **Split-K in one launch** (``split_k.py``): slices of K write fp32 partials and the
  last program of each column block sums them in a fixed order, so the result is
  deterministic and no memset or cast kernel runs.
* **Cheap unpacking.** With fp16 activations, inline PTX turns two nibbles into an exact
  fp16 pair with one ``lop3`` and the 0x6400 magic number (Marlin's trick), recentres
  them and multiplies by x pairs in ``fma.f16x2``: about two instructions per weight.
  bf16 and fp32 activations take an exact float32 path: two nibbles become bf16 128 + code
  in the halves of one int32 (the 0x4300 magic), widened by a shift or a mask, and bf16
  x is read as int32 pairs widened the same way. The interpreter runs all of it in plain
  Triton (bit operations only, so even bf16 is exact there), and CPU tests check the
  same arithmetic the PTX performs.

Zero points (uint8, or GGUF Q4_1's float ones) fold out of the inner loop:
``sum((c - z) x) = sum((c - 8) x) - (z - 8) sum(x)``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from cadence.kernels.formats.quant_formats import SYMMETRIC_ZERO, Int4Weight
from cadence.kernels.triton import split_k

GEMV_MAX_M = 4
BLOCK_N, BLOCK_K = 128, 128
# Programs per SM the split-K count aims at, at most: on Llama-8B's shapes the best split
# per shape (sweep) left 1.7-2.9 programs per SM, and more only added partial traffic.
PROGRAMS_PER_SM = 3
# The interpreter cannot run inline PTX, and ROCm has none.
_ASM = os.environ.get("TRITON_INTERPRET") != "1" and torch.version.hip is None
# How the kernel reads x: float32 elements, or int32 pairs of fp16 / bf16.
X_FP32, X_FP16_PAIRS, X_BF16_PAIRS = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)

# The unpacking recentres codes on 8 (the PTX constants and 2^23 + 8 below): our symmetric zero.
assert SYMMETRIC_ZERO == 8


@triton.jit
def _f16_lo(v):
    return (v & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _f16_hi(v):
    return (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _bf16_half(v, HIGH: tl.constexpr):
    """float32 of the low (HIGH=0) or high bf16 half of an int32: a shift or a mask."""
    if HIGH:
        r = (v & -65536).to(tl.float32, bitcast=True)
    else:
        r = (v << 16).to(tl.float32, bitcast=True)
    return r


@triton.jit
def _pair(a, b, HIGH: tl.constexpr, ASM: tl.constexpr):
    """int32 holding (a.lo, b.lo) as fp16 halves, or (a.hi, b.hi) when HIGH."""
    if ASM:
        if HIGH:
            r = tl.inline_asm_elementwise(
                "prmt.b32 $0, $1, $2, 0x7632;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
            )
        else:
            r = tl.inline_asm_elementwise(
                "prmt.b32 $0, $1, $2, 0x5410;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True, pack=1
            )
    elif HIGH:
        r = ((a >> 16) & 0xFFFF) | ((b >> 16) << 16)
    else:
        r = (a & 0xFFFF) | (b << 16)
    return r


@triton.jit
def _dot8_fp16(words, x0, x1, x2, x3, ASM: tl.constexpr):
    """sum over the 8 nibbles s of (code_s - 8) * x_s, fp32, per int32 of ``words``.

    x_p packs (x of nibble p, x of nibble p + 4) as fp16x2. PTX: ``lop3`` with the 0x6400
    magic puts nibbles (p, p+4) into an fp16 pair as 1024 + code (or 1024 + 16 code for
    the high nibble of a byte); one ``fma.f16x2`` each maps them exactly to (code - 8) / 16;
    four ``fma.f16x2`` multiply by x and accumulate; the two halves are summed in fp32 and
    scaled by 16. The 1/16 keeps the fp16 accumulator 16x from overflow: it holds at most
    four terms of |x| / 2, so only four activations beyond 32,752 in magnitude overflow
    (with (code - 8) itself, one |x| above 8,188 did). tests/test_kernels_ptx.py runs this
    text through a model of each instruction.
    """
    if ASM:
        r = tl.inline_asm_elementwise(
            """
            {
            .reg .b32 t, p0, p1, p2, p3, acc, m0, m1, magic, k16th, km645, k256th, km45;
            .reg .b16 lo, hi;
            .reg .f32 flo, fhi;
            mov.b32 m0, 0x000F000F;
            mov.b32 m1, 0x00F000F0;
            mov.b32 magic, 0x64006400;
            // (1024 + c) / 16 - 64.5 and (1024 + 16 c) / 256 - 4.5 are both (c - 8) / 16.
            mov.b32 k16th, 0x2C002C00;
            mov.b32 km645, 0xD408D408;
            mov.b32 k256th, 0x1C001C00;
            mov.b32 km45, 0xC480C480;
            shr.u32 t, $1, 8;
            lop3.b32 p0, $1, m0, magic, 0xEA;
            lop3.b32 p1, $1, m1, magic, 0xEA;
            lop3.b32 p2, t, m0, magic, 0xEA;
            lop3.b32 p3, t, m1, magic, 0xEA;
            fma.rn.f16x2 p0, p0, k16th, km645;
            fma.rn.f16x2 p1, p1, k256th, km45;
            fma.rn.f16x2 p2, p2, k16th, km645;
            fma.rn.f16x2 p3, p3, k256th, km45;
            mul.f16x2 acc, p0, $2;
            fma.rn.f16x2 acc, p1, $3, acc;
            fma.rn.f16x2 acc, p2, $4, acc;
            fma.rn.f16x2 acc, p3, $5, acc;
            mov.b32 {lo, hi}, acc;
            cvt.f32.f16 flo, lo;
            cvt.f32.f16 fhi, hi;
            add.f32 flo, flo, fhi;
            mul.f32 $0, flo, 0f41800000;
            }
            """,
            "=f,r,r,r,r,r",
            [words, x0, x1, x2, x3],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    else:
        r = (
            (((words >> 0) & 0xF) - 8).to(tl.float32) * _f16_lo(x0)
            + (((words >> 4) & 0xF) - 8).to(tl.float32) * _f16_lo(x1)
            + (((words >> 8) & 0xF) - 8).to(tl.float32) * _f16_lo(x2)
            + (((words >> 12) & 0xF) - 8).to(tl.float32) * _f16_lo(x3)
            + (((words >> 16) & 0xF) - 8).to(tl.float32) * _f16_hi(x0)
            + (((words >> 20) & 0xF) - 8).to(tl.float32) * _f16_hi(x1)
            + (((words >> 24) & 0xF) - 8).to(tl.float32) * _f16_hi(x2)
            + (((words >> 28) & 0xF) - 8).to(tl.float32) * _f16_hi(x3)
        )
    return r


@triton.jit
def _row_partial(words, xp, scale, zero_m8, HAS_ZEROS: tl.constexpr, X_MODE: tl.constexpr, ASM: tl.constexpr):
    """sum_s x_s * (code_s - zero) * scale per word, for one row of x ([NG, GW, BLOCK_N]).

    ``xp [NG, GW]`` points at the x of each word's nibble 0: as int32 fp16 pairs
    (X_MODE 1 fp16, 2 bf16: word w covers pairs 4w .. 4w+3) or as fp32 elements (X_MODE 0,
    nibble s at +s).
    """
    if X_MODE == X_FP16_PAIRS:
        a0 = tl.expand_dims(tl.load(xp), 2)
        a1 = tl.expand_dims(tl.load(xp + 1), 2)
        a2 = tl.expand_dims(tl.load(xp + 2), 2)
        a3 = tl.expand_dims(tl.load(xp + 3), 2)
        # Nibble p and p + 4 of a word hold x[p] and x[p + 4]: pair them up for fma.f16x2.
        x0 = _pair(a0, a2, False, ASM)
        x1 = _pair(a0, a2, True, ASM)
        x2 = _pair(a1, a3, False, ASM)
        x3 = _pair(a1, a3, True, ASM)
        p = _dot8_fp16(words, x0, x1, x2, x3, ASM)
        if HAS_ZEROS:
            xsum = (
                (_f16_lo(x0) + _f16_hi(x0))
                + (_f16_lo(x1) + _f16_hi(x1))
                + (_f16_lo(x2) + _f16_hi(x2))
                + (_f16_lo(x3) + _f16_hi(x3))
            )
            p = p - zero_m8 * xsum
    else:
        # Nibbles j and j + 4 land in the two halves of one int32 as bf16 128 + code (the
        # 0x4300 magic), each half widened to float32 by a shift or a mask: exact, about
        # three instructions per weight. The 128 + 8 (+ zero - 8) offset is taken off once
        # per word, against sum(x).
        if X_MODE == X_BF16_PAIRS:  # x0..x7 from four int32 bf16 pairs, widened the same way
            a0 = tl.expand_dims(tl.load(xp), 2)
            a1 = tl.expand_dims(tl.load(xp + 1), 2)
            a2 = tl.expand_dims(tl.load(xp + 2), 2)
            a3 = tl.expand_dims(tl.load(xp + 3), 2)
        for j in tl.static_range(4):
            pair = ((words >> (4 * j)) & 0x000F000F) | 0x43004300
            code_lo = (pair << 16).to(tl.float32, bitcast=True)
            code_hi = (pair & -65536).to(tl.float32, bitcast=True)
            if X_MODE == X_BF16_PAIRS:
                x_lo = _bf16_half(a0 if j < 2 else a1, j % 2)
                x_hi = _bf16_half(a2 if j < 2 else a3, j % 2)
            else:
                x_lo = tl.expand_dims(tl.load(xp + j), 2).to(tl.float32)
                x_hi = tl.expand_dims(tl.load(xp + j + 4), 2).to(tl.float32)
            if j == 0:
                p = code_lo * x_lo + code_hi * x_hi
                xsum = x_lo + x_hi
            else:
                p = p + code_lo * x_lo + code_hi * x_hi
                xsum = xsum + x_lo + x_hi
        if HAS_ZEROS:
            p = p - (136.0 + zero_m8) * xsum
        else:
            p = p - 136.0 * xsum
    return p * scale


@triton.jit
def _load_scales(s_ptr, z_ptr, offs, mask, HAS_ZEROS: tl.constexpr):
    """Scales and (zero - 8) as fp32 at ``offs`` (the zero term is unused when symmetric)."""
    scale = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_ZEROS:
        zero_m8 = tl.load(z_ptr + offs, mask=mask, other=0).to(tl.float32) - 8.0
    else:
        zero_m8 = scale
    return scale, zero_m8


@triton.jit
def _store_row(out_ptr, ws_ptr, row, acc, offs_n, mask_n, pid_k, N, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr):
    res = tl.sum(tl.sum(acc, axis=1), axis=0)
    if SPLIT:
        tl.store(ws_ptr + (pid_k * BLOCK_M + row) * N + offs_n, res, mask=mask_n)
    else:
        tl.store(out_ptr + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    ws_ptr,
    counter_ptr,
    N,
    k_per_split,
    num_splits,
    stride_xm,
    stride_om,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NG: tl.constexpr,
    GW: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    X_MODE: tl.constexpr,
    ASM: tl.constexpr,
    SPLIT: tl.constexpr,
    EVEN_N: tl.constexpr,
):
    """Program (n, s): output columns [n BN, (n+1) BN) of every row over K slice s.

    A tile is ``[NG, GW, BLOCK_N]`` words: NG groups of GW packed rows each, so one scale
    row serves a whole group slice.
    """
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    groups = tl.arange(0, NG)
    word_rows = groups[:, None] * GW + tl.arange(0, GW)[None, :]  # [NG, GW] packed rows of a tile
    acc0 = tl.zeros([NG, GW, BLOCK_N], tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    k_lo = pid_k * k_per_split
    k_last = k_lo + k_per_split - BLOCK_K
    scale_mask = mask_n[None, :]
    next_scale, next_zero = _load_scales(
        s_ptr, z_ptr, (k_lo // GROUP + groups)[:, None] * N + offs_n[None, :], scale_mask, HAS_ZEROS
    )
    for k0 in tl.range(k_lo, k_lo + k_per_split, BLOCK_K, num_stages=NUM_STAGES):
        scale = tl.expand_dims(next_scale, 1)
        zero_m8 = tl.expand_dims(next_zero, 1)
        # The next tile's scales now, so their latency overlaps this tile's math (the last
        # iteration re-reads its own: clamped, harmless).
        k_next = tl.minimum(k0 + BLOCK_K, k_last)
        next_scale, next_zero = _load_scales(
            s_ptr, z_ptr, (k_next // GROUP + groups)[:, None] * N + offs_n[None, :], scale_mask, HAS_ZEROS
        )
        word_ptrs = qw_ptr + (k0 // 8 + word_rows)[:, :, None] * N + offs_n[None, None, :]
        if EVEN_N:  # no mask: keeps the 16-byte vector loads
            words = tl.load(word_ptrs)
        else:
            words = tl.load(word_ptrs, mask=mask_n[None, None, :], other=0)
        if X_MODE != X_FP32:
            xp = x_ptr + k0 // 2 + word_rows * 4  # int32 units: word w covers x[8w .. 8w+7]
        else:
            xp = x_ptr + k0 + word_rows * 8
        acc0 += _row_partial(words, xp, scale, zero_m8, HAS_ZEROS, X_MODE, ASM)
        if BLOCK_M > 1:
            acc1 += _row_partial(words, xp + stride_xm, scale, zero_m8, HAS_ZEROS, X_MODE, ASM)
        if BLOCK_M > 2:
            acc2 += _row_partial(words, xp + 2 * stride_xm, scale, zero_m8, HAS_ZEROS, X_MODE, ASM)
        if BLOCK_M > 3:
            acc3 += _row_partial(words, xp + 3 * stride_xm, scale, zero_m8, HAS_ZEROS, X_MODE, ASM)
    _store_row(out_ptr, ws_ptr, 0, acc0, offs_n, mask_n, pid_k, N, BLOCK_M, SPLIT)
    if BLOCK_M > 1:
        _store_row(out_ptr + stride_om, ws_ptr, 1, acc1, offs_n, mask_n, pid_k, N, BLOCK_M, SPLIT)
    if BLOCK_M > 2:
        _store_row(out_ptr + 2 * stride_om, ws_ptr, 2, acc2, offs_n, mask_n, pid_k, N, BLOCK_M, SPLIT)
    if BLOCK_M > 3:
        _store_row(out_ptr + 3 * stride_om, ws_ptr, 3, acc3, offs_n, mask_n, pid_k, N, BLOCK_M, SPLIT)
    if SPLIT:
        split_k.finish(
            ws_ptr, counter_ptr, out_ptr, stride_om, pid_n, offs_n, mask_n, BLOCK_M, N, num_splits, BLOCK_M, BLOCK_N
        )


def tile_groups(block_k: int, group: int) -> tuple[int, int] | None:
    """(groups per tile, packed rows per group slice), or None if the group does not fit."""
    if block_k >= group:
        return (block_k // group, group // 8) if block_k % group == 0 else None
    return (1, block_k // 8) if group % block_k == 0 else None


def choose_splits(n_blocks: int, k_tiles: int, num_sms: int) -> int:
    """The largest power of two keeping programs <= PROGRAMS_PER_SM per SM, dividing the K tiles."""
    split = 1
    while n_blocks * split * 2 <= PROGRAMS_PER_SM * num_sms and k_tiles % (split * 2) == 0:
        split *= 2
    return split


def supports(x2: torch.Tensor, weight: Int4Weight) -> bool:
    """Whether this kernel takes the product: M <= 4 and K in whole tiles of its groups."""
    k = weight.in_features
    return x2.shape[0] <= GEMV_MAX_M and k % BLOCK_K == 0 and tile_groups(BLOCK_K, weight.group_size) is not None


def w4a16_gemv(x2: torch.Tensor, weight: Int4Weight, out: torch.Tensor, num_sms: int) -> None:
    """``out [M, N] = x2 [M, K] @ dequant(weight).T`` for M <= 4 (see ``supports``)."""
    m, k = x2.shape
    n, group = weight.out_features, weight.group_size
    groups = tile_groups(BLOCK_K, group)
    assert supports(x2, weight) and groups is not None and out.shape == (m, n) and out.stride(1) == 1
    ng, gw = groups
    n_blocks = triton.cdiv(n, BLOCK_N)
    splits = choose_splits(n_blocks, k // BLOCK_K, num_sms)
    x_mode = {torch.float16: X_FP16_PAIRS, torch.bfloat16: X_BF16_PAIRS}.get(x2.dtype, X_FP32).value
    x_arg = x2.contiguous()
    if x_mode != X_FP32.value:
        x_arg = x_arg.view(torch.int32)  # pairs, 4-byte aligned: K is a multiple of 128
    has_zeros = weight.zeros is not None
    partials = split_k.workspace(splits, m, n, n_blocks, out)
    _w4a16_gemv_kernel[(n_blocks, splits)](
        x_arg,
        weight.qweight,
        weight.scales,
        weight.zeros if has_zeros else weight.scales,
        out,
        partials,
        split_k.counters(x2.device),
        n,
        k // splits,
        splits,
        x_arg.stride(0),
        out.stride(0),
        GROUP=group,
        HAS_ZEROS=has_zeros,
        BLOCK_M=m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        NG=ng,
        GW=gw,
        NUM_STAGES=3,
        X_MODE=x_mode,
        ASM=_ASM,
        SPLIT=splits > 1,
        EVEN_N=n % BLOCK_N == 0,
        num_warps=4,
        num_stages=3,
    )
