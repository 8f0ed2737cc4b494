"""Unified paged attention: one Triton kernel for a flat batch of decodes and prefill chunks.

The batch is varlen: sequence s owns query rows `query_start_loc[s]:query_start_loc[s+1]`
of `q` and has `seq_lens[s]` tokens of context in total (its new tokens included, already
written to the cache). Its K/V live in the paged cache `[2, num_blocks, block_size,
num_kv_heads, head_dim]` at the blocks listed in row s of `block_tables`.

One program owns one tile of BLOCK_Q query tokens of one sequence and one KV head. All
GROUP query heads of that KV head are packed into the rows of the tile (row r = token
r // GROUP, head r % GROUP), so each K/V tile is read once for the whole group. The
program walks its KV range TILE_N positions at a time (a tile may span several cache
blocks, each position finds its block through the block table) with an online softmax.

Split-KV: with few sequences and long contexts most SMs would idle, so the KV range of
each program is cut into `num_splits` pieces run by separate programs; each writes an
unnormalized partial output with its running max and sum, and `_merge_kernel` combines
them with log-sum-exp weights.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.triton.fp8_bits import FP16_DECODE_DIVISOR, e4m3_bits_to_fp16
from cadence.kernels.triton.launch import num_sms as gpu_sm_count

FP8_UNDO = tl.constexpr(FP16_DECODE_DIVISOR)  # decoded e4m3 bytes are this much too small

_LOG2E = 1.4426950408889634


def reference(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    window: int | None = None,
    kv_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the kernel computes, in fp32 plain torch, one sequence at a time.

    A quantized cache (int8 / fp8) comes with `kv_scales [2, num_blocks, block_size,
    num_kv_heads]`: K/V are the stored values times their row's scale.
    """
    if kv_scales is not None:
        kv_cache = kv_cache.float() * kv_scales[..., None]
    _, num_blocks, block_size, num_kv_heads, head_dim = kv_cache.shape
    num_heads = q.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for s, seq_len in enumerate(lens):
        q_start, q_end = starts[s], starts[s + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[s].long()[pos // block_size] * block_size + pos % block_size
        keys = kv_cache[0].reshape(-1, num_kv_heads, head_dim)[slots].float()  # [L, Hkv, D]
        values = kv_cache[1].reshape(-1, num_kv_heads, head_dim)[slots].float()
        keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[q_start:q_end].float(), keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
        mask = pos[None, :] <= q_pos
        if window is not None:
            mask &= pos[None, :] > q_pos - window
        scores = scores.masked_fill(~mask, float("-inf"))
        out[q_start:q_end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out


def choose_num_splits(
    num_seqs: int,
    num_kv_heads: int,
    max_seq_len: int,
    num_sms: int,
    *,
    min_tokens_per_split: int = 256,
    max_splits: int = 32,
) -> int:
    """How many pieces to cut each KV range into.

    `num_seqs * num_kv_heads` programs run without splitting (pass the number of query
    tiles as `num_seqs` for multi-token chunks). Splitting only pays when that leaves SMs
    idle: then use enough splits to occupy them, but never so many that a split gets
    fewer than `min_tokens_per_split` positions of the longest context (each split costs
    a partial write and a share of the merge).
    """
    programs = max(1, num_seqs * num_kv_heads)
    if programs >= num_sms:
        return 1
    by_occupancy = -(-num_sms // programs)
    by_length = max_seq_len // max(1, min_tokens_per_split)
    return max(1, min(by_occupancy, by_length, max_splits))


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    qk_scale,
    window,
    num_seqs,
    num_splits,
    num_tokens,
    num_heads,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
    QUANT_KV: tl.constexpr,
    KV_FP8_BITS: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # Sequence s owns programs [qsl[s] // BLOCK_Q + s, qsl[s+1] // BLOCK_Q + s + 1): at
    # least cdiv(q_len, BLOCK_Q) of them. Find the last s whose first program <= pid_q.
    # (Tensors from the start: num_seqs == 1 would be specialized to a constexpr.)
    lo = pid_q * 0
    hi = lo + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(first <= pid_q, mid, lo)
        hi = tl.where(first <= pid_q, hi, mid - 1)
    seq = lo
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = pid_q - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_tok = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = (rows // GROUP < BLOCK_Q) & (q_tok < q_len)
    q_pos = context + q_tok
    dims = tl.arange(0, HEAD_PAD)
    dim_valid = dims < HEAD_DIM
    token = (q_start + q_tok).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )

    # KV positions this tile can see, in whole TILE_N tiles, then this split's share.
    kv_hi = context + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(context + q_block * BLOCK_Q - window + 1, 0)
    tile_lo = kv_lo // TILE_N
    tile_hi = tl.cdiv(kv_hi, TILE_N)
    per_split = tl.cdiv(tile_hi - tile_lo, num_splits)
    t0 = tile_lo + split * per_split
    t1 = tl.minimum(t0 + per_split, tile_hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for t in range(t0, t1):
        pos = t * TILE_N + tl.arange(0, TILE_N)
        pos_valid = pos < kv_hi
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
        in_block = (pos % BLOCK_SIZE).to(tl.int64)
        kv_mask = pos_valid[:, None] & dim_valid[None, :]
        k_off = block * stride_kb + in_block * stride_ks + kv_head * stride_kh
        k = tl.load(k_ptr + k_off[None, :] + dims[:, None], mask=kv_mask.T, other=0.0)
        if QUANT_KV:  # one scale per (position, KV head): dequantize the tile in registers
            scale_off = block * stride_sb + in_block * stride_ss + kv_head
            k_scale = tl.load(k_scale_ptr + scale_off, mask=pos_valid, other=0.0)
            if KV_FP8_BITS:  # uint8 view of an e4m3 cache (see kernels/triton/fp8_bits.py)
                k = e4m3_bits_to_fp16(k).to(tl.float32) * FP8_UNDO
            k = (k.to(tl.float32) * k_scale[None, :]).to(q.dtype)
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, TILE_N], log2 units
        visible = pos[None, :] <= q_pos[:, None]
        if USE_WINDOW:
            visible &= pos[None, :] > q_pos[:, None] - window
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = block * stride_vb + in_block * stride_vs + kv_head * stride_vh
        v = tl.load(v_ptr + v_off[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        if QUANT_KV:
            v_scale = tl.load(v_scale_ptr + scale_off, mask=pos_valid, other=0.0)
            if KV_FP8_BITS:
                v = e4m3_bits_to_fp16(v).to(tl.float32) * FP8_UNDO
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    store_mask = row_valid[:, None] & dim_valid[None, :]
    if SPLIT:
        # Partials are contiguous [num_splits, num_tokens, num_heads(, HEAD_PAD)].
        row = (split * num_tokens + token) * num_heads + head
        tl.store(part_out_ptr + row[:, None] * HEAD_PAD + dims[None, :], acc, mask=store_mask)
        tl.store(part_m_ptr + row, m_i, mask=row_valid)
        tl.store(part_l_ptr + row, l_i, mask=row_valid)
    else:
        out = acc / tl.where(row_valid, l_i, 1.0)[:, None]  # padding rows have l = 0
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )


@triton.jit
def _merge_kernel(
    part_out_ptr,
    part_m_ptr,
    part_l_ptr,
    out_ptr,
    num_splits,
    num_tokens,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """One program per (token, head): weight each split by 2^(m_split - m_max)."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < num_splits
    row = (splits * num_tokens + token) * num_heads + head
    m = tl.load(part_m_ptr + row, mask=split_valid, other=float("-inf"))
    sums = tl.load(part_l_ptr + row, mask=split_valid, other=0.0)
    m_max = tl.max(m, 0)
    weight = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    dims = tl.arange(0, HEAD_PAD)
    part = tl.load(
        part_out_ptr + row[:, None] * HEAD_PAD + dims[None, :],
        mask=split_valid[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(part * weight[:, None], 0) / tl.sum(sums * weight, 0)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + dims,
        out.to(out_ptr.dtype.element_ty),
        mask=dims < HEAD_DIM,
    )


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int | None = None,
    num_splits: int | None = None,
    *,
    max_seq_len: int | None = None,
    num_sms: int | None = None,
    out: torch.Tensor | None = None,
    kv_scales: torch.Tensor | None = None,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """Attention of `q [T, num_heads, head_dim]` over the paged cache; see `reference`.

    With `kv_scales` the cache holds int8 or fp8 values, dequantized tile by tile.

    `batch_invariant` gives every query row the same bits whatever else is in the batch
    and however its sequence's prompt was chunked: decodes take the prefill tiles, and the
    KV range is never split (`num_splits` must be None or 1). A row then always walks the
    same TILE_N tiles from position 0 in the same order; tiles past its own position are
    masked to exact no-ops of the online softmax.

    `seq_lens` and `query_start_loc` are int32/int64 device tensors, `block_tables` is
    `[num_seqs, max_blocks]` int32/int64. `num_splits=None` picks it with
    `choose_num_splits` (that needs `max_seq_len`, read from `seq_lens` if not given;
    `num_sms` defaults to the GPU's SM count, or a nominal 8 on CPU).
    """
    num_tokens, num_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, cache_head_dim = kv_cache.shape
    assert cache_head_dim == head_dim and num_heads % num_kv_heads == 0
    assert q.stride(2) == 1 and kv_cache.stride(4) == 1
    assert window is None or window >= 1
    num_seqs = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(2) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    if batch_invariant:
        if num_splits not in (None, 1):
            raise ValueError(f"batch-invariant attention does not split the KV range (num_splits={num_splits})")
        num_splits = 1
    prefill_tiles = max_query_len > 1 or batch_invariant
    # Rows of a tile = BLOCK_Q tokens x GROUP heads; tl.dot wants at least 16 of them.
    block_m = 64 if prefill_tiles else 16
    block_m = max(block_m, triton.next_power_of_2(group))
    block_q = block_m // group
    tile_n = 32 if prefill_tiles else 16
    head_pad = max(16, triton.next_power_of_2(head_dim))
    num_q_programs = num_tokens // block_q + num_seqs
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max())
        busy = min(num_q_programs, num_seqs * -(-max_query_len // block_q))
        num_splits = choose_num_splits(busy, num_kv_heads, max_seq_len, num_sms or gpu_sm_count(q.device))
    split = num_splits > 1
    if split:
        part_out = torch.empty(num_splits, num_tokens, num_heads, head_pad, dtype=torch.float32, device=q.device)
        part_m = torch.empty(num_splits, num_tokens, num_heads, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out
    # fp8 is read as bytes and decoded in the kernel: Triton's e4m3 type does not compile
    # below compute capability 8.9 (A100), and the decode costs nothing next to the load.
    fp8_bits = kv_cache.dtype == torch.float8_e4m3fn
    assert not fp8_bits or kv_scales is not None, "an fp8 KV cache carries a scale per token and head"
    k_cache, v_cache = (kv_cache.view(torch.uint8) if fp8_bits else kv_cache).unbind(0)
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    quant_kv = kv_scales is not None
    if kv_scales is not None:
        assert kv_scales.shape == kv_cache.shape[:4] and kv_scales.dtype == torch.float32 and kv_scales.is_contiguous()
    scales = kv_scales if kv_scales is not None else seq_lens.new_empty(2, 1, 1, 1, dtype=torch.float32)
    _attention_kernel[(num_q_programs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        out,
        part_out,
        part_m,
        part_l,
        block_tables,
        seq_lens,
        query_start_loc,
        scales[0],
        scales[1],
        scales.stride(1),
        scales.stride(2),
        scale * _LOG2E,
        window or 0,
        num_seqs,
        num_splits,
        num_tokens,
        num_heads,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        HEAD_DIM=head_dim,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        USE_WINDOW=window is not None,
        SPLIT=split,
        PRECISION=precision,
        QUANT_KV=quant_kv,
        KV_FP8_BITS=fp8_bits,
        # A 64-row prefill tile of 128-wide heads needs 255+ registers a thread at 4 warps
        # and spills (ptxas, sm_80/sm_90: tests/test_kernels_compile.py); 8 warps halve it.
        num_warps=8 if block_m * head_pad >= 64 * 128 else 4,
    )
    if split:
        _merge_kernel[(num_tokens, num_heads)](
            part_out,
            part_m,
            part_l,
            out,
            num_splits,
            num_tokens,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_PAD=head_pad,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out


__all__ = ["choose_num_splits", "paged_attention", "reference"]
