"""Rotary position embedding of q and k, in place, in one Triton kernel.

The torch version (``layer_ops_reference.rotary``) gathers cos/sin for the positions, casts
them, and rotates q and k with a roll, two multiplies and an add each: about ten launches
per layer. Here one program rotates every head of one token, q and k
together, writing back into their (possibly strided, e.g. views of the fused qkv output)
storage.

Layout is Hugging Face's non-interleaved one: dimension i pairs with i + head_dim / 2.
cos/sin are rounded to the activation dtype as in the torch code, but each rotated value
is computed in float32 and rounded once, where torch rounds every product and sum (the
compiler would fuse them into multiply-adds anyway): within a unit in the last place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.layer_ops_reference import rotary as reference


@triton.jit
def _rotate_heads(ptr, stride_t, stride_h, token, num_heads, cos, sin, half, HEADS: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS)
    dims = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None] & (dims < half)[None, :]
    p1 = ptr + token * stride_t + heads[:, None] * stride_h + dims[None, :]
    p2 = p1 + half
    dtype = ptr.dtype.element_ty
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    tl.store(p1, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(p2, (x2 * cos + x1 * sin).to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    num_heads,
    num_kv_heads,
    half,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_table,
    Q_HEADS: tl.constexpr,
    K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(pos_ptr + token).to(tl.int64)
    dims = tl.arange(0, HALF)
    dtype = q_ptr.dtype.element_ty
    cos = tl.load(cos_ptr + position * stride_table + dims, mask=dims < half, other=0.0)
    sin = tl.load(sin_ptr + position * stride_table + dims, mask=dims < half, other=0.0)
    cos = cos.to(dtype).to(tl.float32)[None, :]
    sin = sin.to(dtype).to(tl.float32)[None, :]
    _rotate_heads(q_ptr, stride_qt, stride_qh, token, num_heads, cos, sin, half, Q_HEADS, HALF)
    _rotate_heads(k_ptr, stride_kt, stride_kh, token, num_kv_heads, cos, sin, half, K_HEADS, HALF)


def apply_rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``reference`` computes, written into ``q`` and ``k`` in place (returned)."""
    num_tokens, num_heads, head_dim = q.shape
    assert k.shape[0] == num_tokens and k.shape[2] == head_dim and q.dtype == k.dtype
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos.is_contiguous() and sin.is_contiguous()
    assert cos.shape == sin.shape and cos.shape[1] == head_dim // 2
    if num_tokens:
        half = head_dim // 2
        _rotary_kernel[(num_tokens,)](
            positions,
            q,
            k,
            cos,
            sin,
            num_heads,
            k.shape[1],
            half,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            Q_HEADS=triton.next_power_of_2(num_heads),
            K_HEADS=triton.next_power_of_2(k.shape[1]),
            HALF=triton.next_power_of_2(half),
            num_warps=4,
        )
    return q, k


__all__ = ["apply_rotary", "reference"]
