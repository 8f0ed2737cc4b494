"""Write a step's new K/V into their slots of the paged cache.

The cache for one layer is `[2, num_blocks, block_size, num_kv_heads, head_dim]` (index
0 keys, 1 values). Token t goes to slot `slot_mapping[t] = block * block_size + offset`;
a slot of -1 (padding) is skipped. One program writes one token, all heads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def reference(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """In place, plain torch: kv_cache[:, slot // block_size, slot % block_size] = k, v."""
    block_size = kv_cache.shape[2]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blocks, offsets = slots // block_size, slots % block_size
    kv_cache[0, blocks, offsets] = k[keep].to(kv_cache.dtype)
    kv_cache[1, blocks, offsets] = v[keep].to(kv_cache.dtype)


@triton.jit
def _write_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_cs, stride_ch, stride_vcb, stride_vcs, stride_vch,
    num_kv_heads,
    HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
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
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Write `k, v [T, num_kv_heads, head_dim]` into `kv_cache` at `slot_mapping [T]`, in place."""
    num_tokens, num_kv_heads, head_dim = k.shape
    _, _, block_size, cache_heads, cache_dim = kv_cache.shape
    assert v.shape == k.shape and (cache_heads, cache_dim) == (num_kv_heads, head_dim)
    assert k.stride(2) == 1 and v.stride(2) == 1 and kv_cache.stride(4) == 1
    assert slot_mapping.shape == (num_tokens,)
    if num_tokens == 0:
        return
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    _write_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        num_kv_heads,
        HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=block_size,
    )


__all__ = ["reference", "write_kv_cache"]
