"""Quantized KV-cache rows in plain torch: the format both attention backends share.

A quantized cache (int8, or fp8 e4m3) stores each (token, KV head) row scaled so its
largest magnitude lands on the format's largest value, with the float32 scale kept in
`kv_scales [2, num_blocks, block_size, num_kv_heads]`: stored value × scale gives K/V
back. A scale per row keeps every row's relative error the same whatever the magnitudes
of other tokens. No triton here: the CPU backend uses this module directly.
"""

from __future__ import annotations

import torch

KV_CACHE_DTYPES: dict[str, torch.dtype] = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def quantized_max(dtype: torch.dtype) -> float:
    """The largest value a quantized cache stores: a row's absmax maps onto it."""
    if dtype == torch.int8:
        return 127.0
    if dtype.is_floating_point and dtype.itemsize == 1:
        return float(torch.finfo(dtype).max)
    raise ValueError(f"{dtype} is not a quantized KV-cache dtype (int8 or an fp8 type)")


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (stored values, float32 scale per row) for a quantized cache."""
    top = quantized_max(dtype)
    scale = x.float().abs().amax(dim=-1) / top
    scaled = x.float() / torch.where(scale > 0, scale, 1.0)[..., None]
    stored = scaled.round().clamp(-top, top).to(dtype) if dtype == torch.int8 else scaled.to(dtype)
    return stored, scale


def dequantize_rows(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Back to `dtype`: stored [..., head_dim] times its row's scale [...]."""
    return (stored.float() * scale[..., None]).to(dtype)
