"""Write a step's new K/V into their slots of the paged cache.

The cache for one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index
0 keys, 1 values). Token t goes to slot `slot_mapping[t] = block * block_size + offset`;
a slot of -1 (padding) is skipped. One program writes one token, all heads.

Quantized caches (int8 or fp8) carry a scale per token and KV head in `kv_scales`; the
format is defined in kernels/formats/kv_quant.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.formats.kv_quant import quantize_rows, quantized_max
from cadence.kernels.triton.launch import has_fp8_hardware


def reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """In place, plain torch: kv_cache[:, slot // block_size, slot % block_size] = k, v."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    # fp8 goes in through a uint8 view: the same bits, and indexed stores on uint8 are
    # supported on every device, fp8 ones not everywhere.
    fp8 = kv_cache.dtype == torch.float8_e4m3fn
    cache = kv_cache.view(torch.uint8) if fp8 else kv_cache
    for index, x in enumerate((k[keep], v[keep])):
        if kv_scales is None:
            values = x.to(kv_cache.dtype)
        else:
            values, kv_scales[index, blocks, offsets] = quantize_rows(x, kv_cache.dtype)
        cache[index, blocks, offsets] = values.view(torch.uint8) if fp8 else values


@triton.jit
def _write_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_mapping_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    k_scale_ptr,
    v_scale_ptr,
    stride_sb,
    stride_ss,
    num_kv_heads,
    quant_max,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    QUANT: tl.constexpr,
    ROUND: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    k_dst = k_cache_ptr + block * stride_cb + offset * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads[:, None] * stride_vch + dims[None, :]
    if QUANT:
        scale_off = block * stride_sb + offset * stride_ss + heads
        k, k_scale = _quantize(k, quant_max, ROUND)
        v, v_scale = _quantize(v, quant_max, ROUND)
        tl.store(k_scale_ptr + scale_off, k_scale, mask=heads < num_kv_heads)
        tl.store(v_scale_ptr + scale_off, v_scale, mask=heads < num_kv_heads)
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize(x, quant_max, ROUND: tl.constexpr):
    """Rows of x scaled so each row's absmax is quant_max; returns (values, scale per row)."""
    x = x.to(tl.float32)
    scale = tl.max(tl.abs(x), 1) / quant_max
    x = x / tl.where(scale > 0, scale, 1.0)[:, None]
    if ROUND:  # integers round to nearest (ties away from zero); fp8 rounds in the final cast
        x = tl.where(x >= 0, tl.floor(x + 0.5), -tl.floor(-x + 0.5))
        x = tl.minimum(tl.maximum(x, -quant_max), quant_max)
    return x, scale


def _kernel_writes(kv_cache: torch.Tensor) -> bool:
    """Whether the kernel can store this cache's dtype: Triton's e4m3 type needs compute
    capability 8.9+, so an fp8 cache on an older GPU (A100) is written by ``reference``
    (the attention kernel reads fp8 as bytes, so it runs there either way)."""
    return kv_cache.dtype != torch.float8_e4m3fn or not kv_cache.is_cuda or has_fp8_hardware(kv_cache.device)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: torch.Tensor | None = None,
) -> None:
    """Write `k, v [T, num_kv_heads, head_dim]` into `kv_cache` at `slot_mapping [T]`, in place.

    With `kv_scales` the cache is quantized (int8 or fp8) and each row's scale goes there.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    _, _, block_size, cache_heads, cache_dim = kv_cache.shape
    assert v.shape == k.shape and (cache_heads, cache_dim) == (num_kv_heads, head_dim)
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1
    assert slot_mapping.shape == (num_tokens,)
    if num_tokens == 0:
        return
    if not _kernel_writes(kv_cache):
        reference(k, v, kv_cache, slot_mapping, kv_scales)
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    quant = kv_scales is not None
    if kv_scales is not None:
        assert kv_scales.shape == kv_cache.shape[:4] and kv_scales.dtype == torch.float32 and kv_scales.is_contiguous()
    scales = kv_scales if kv_scales is not None else torch.empty(2, 1, 1, 1, device=k.device)
    _write_kernel[(num_tokens,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        scales[0],
        scales[1],
        scales.stride(1),
        scales.stride(2),
        num_kv_heads,
        quantized_max(kv_cache.dtype) if quant else 1.0,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=block_size,
        QUANT=quant,
        ROUND=kv_cache.dtype == torch.int8,
    )


__all__ = ["reference", "write_kv_cache"]
