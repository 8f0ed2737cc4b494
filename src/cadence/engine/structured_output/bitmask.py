"""Applying packed token bitmasks [K, ceil(V / 32)] int32 to rows of logits [B, V].

Bit ``t % 32`` of word ``t // 32`` allows token ``t`` (llguidance's layout). On CUDA a
Triton kernel does it in one launch; elsewhere vectorized torch unpacks the bits a byte at
a time, which keeps the temporary at one byte per token.
"""

from __future__ import annotations

import torch

from cadence.kernels.triton.launch import triton_usable

_BITS = torch.arange(8, dtype=torch.uint8)


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row for a vocabulary of `vocab_size` tokens."""
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[K, V] bool: which tokens each row of a CPU bitmask allows."""
    # Little-endian words (every platform torch ships for): byte j holds tokens 8j .. 8j + 7.
    as_bytes = bitmask.contiguous().view(torch.uint8)
    bits = (as_bytes.unsqueeze(-1) >> _BITS.to(as_bytes.device)) & 1
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0 (vectorized torch)."""
    if rows.numel() == 0:
        return
    allowed = allowed_tokens(bitmask, logits.shape[-1])
    selected = logits[rows]
    logits[rows] = selected.masked_fill_(~allowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: the grammar masks of `rows` on their logits, by the fastest path here."""
    if logits.is_cuda and triton_usable(logits):
        # Imported on use: Triton ships for Linux only, and CPU hosts elsewhere never need it.
        from cadence.kernels.triton.token_bitmask import apply_token_bitmask as triton_apply

        triton_apply(logits, bitmask, rows)
    else:
        apply_token_bitmask_reference(logits, bitmask, rows)
