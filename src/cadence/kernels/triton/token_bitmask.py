"""A grammar's packed token bitmask applied to logits rows, in one launch.

The bitmask holds one bit per token, 32 to an int32 word, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed (llguidance's layout). Each program reads one
block of a row's logits and the words covering it, and writes -inf where the bit is 0.
Only the rows named in ``rows`` are touched, so constrained and unconstrained rows share
a batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, stride_logits, stride_mask, BLOCK: tl.constexpr):
    index = tl.program_id(0)
    row = tl.load(rows_ptr + index).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_vocab = tokens < vocab
    words = tl.load(bitmask_ptr + index.to(tl.int64) * stride_mask + tokens // 32, mask=in_vocab, other=0)
    banned = ((words >> (tokens % 32)) & 1) == 0
    pointers = logits_ptr + row * stride_logits + tokens
    tl.store(pointers, tl.full([BLOCK], float("-inf"), logits_ptr.dtype.element_ty), mask=in_vocab & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: logits[rows[i], t] = -inf where bit t of bitmask[i] is 0.

    logits [B, V] (rows contiguous), bitmask [K, ceil(V / 32)] int32, rows [K] int64, all
    on the logits' device."""
    if logits.stride(-1) != 1 or bitmask.stride(-1) != 1:
        raise ValueError("logits and bitmask rows must be contiguous")
    num_rows, vocab = rows.shape[0], logits.shape[-1]
    if num_rows == 0:
        return
    block = min(2048, triton.next_power_of_2(vocab))
    _token_bitmask_kernel[(num_rows, triton.cdiv(vocab, block))](
        logits, bitmask, rows, vocab, logits.stride(0), bitmask.stride(0), BLOCK=block, num_warps=4
    )
