"""Reading codes back out of ``_convert_weight_to_int4pack_for_cpu``'s layout.

``Int4Method`` keeps a CPU weight only in the layout torch's packed op reads (holding
our own copy too would double the weight). That op is the fast path up to moderate batch
sizes, but it is compute-bound and slow for prefill, several times slower than
dequantizing the weight and running the AMX bf16 matmul (bench/RESULTS.md). Dequantizing
needs the codes, so this module unpacks them from torch's layout.

The layout is torch's private business. Observed with torch 2.13 on AVX-512: for N a
multiple of 64, ``uint8 [N // 64, K, 32]``, where byte ``b`` of a 64-row block holds row
``b`` in its low nibble and row ``b + 32`` in its high nibble. Other block widths are
tried as well, and a layer uses the unpacker only after it has reproduced that layer's
own codes exactly at load time (``matching_block_n``); otherwise it keeps the packed op
at every batch size.
"""

from __future__ import annotations

import torch

_CANDIDATE_BLOCKS = (64, 32, 16)


def unpack_cpu_int4(packed: torch.Tensor, n: int, k: int, block_n: int) -> torch.Tensor:
    """Codes ``uint8 [N, K]`` from the packed op's ``[N, K / 2]`` bytes, for one block width."""
    blocks = packed.reshape(n // block_n, k, block_n // 2)
    nibbles = torch.cat([blocks & 0xF, blocks >> 4], dim=-1)  # [N / block, K, block]
    return nibbles.transpose(1, 2).reshape(n, k)


def matching_block_n(packed: torch.Tensor, codes: torch.Tensor) -> int | None:
    """The block width whose unpacking gives back ``codes`` ``[N, K]`` exactly, if any."""
    n, k = codes.shape
    for block_n in _CANDIDATE_BLOCKS:
        if n % block_n == 0 and packed.numel() * 2 == n * k:
            if torch.equal(unpack_cpu_int4(packed, n, k, block_n), codes.to(torch.uint8)):
                return block_n
    return None


def dequantize_cpu_int4_transposed(
    packed: torch.Tensor,
    scales_zeros: torch.Tensor,
    n: int,
    k: int,
    group_size: int,
    block_n: int,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The dense weight's transpose ``[K, N]`` in ``dtype``: ``(code - 8) * scale + zero``,
    the packed op's formula, with its ``[K / group, N, 2]`` scales-and-zeros.

    ``[K, N]`` because that is the packed bytes' own order (a 64-row block's bytes run
    along K with the rows innermost), so the nibbles land in place with two strided copies
    and no transpose pass, and the scales broadcast along the contiguous N. The arithmetic
    runs in fp32, where CPU elementwise kernels are several times faster than in bf16 with
    broadcasting: ``code * scale`` (4 x 8 significant bits) and adding ``zero - 8 * scale``
    are exact there, so the one rounding to bf16 gives what a bf16 ``addcmul`` gives; in
    float32 there is no rounding at the end at all.
    """
    half = block_n // 2
    blocks = packed.view(n // block_n, k, half)
    codes = torch.empty(k, n // block_n, 2, half, dtype=torch.float32)
    codes[:, :, 0] = (blocks & 0xF).transpose(0, 1)
    codes[:, :, 1] = (blocks >> 4).transpose(0, 1)
    scale = scales_zeros[..., 0].float().unsqueeze(1)  # [K / group, 1, N]
    offset = scales_zeros[..., 1].float().unsqueeze(1) - 8 * scale
    grouped = codes.view(k // group_size, group_size, n)
    return grouped.mul_(scale).add_(offset).view(k, n).to(dtype)
