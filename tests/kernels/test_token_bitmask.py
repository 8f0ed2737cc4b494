"""The grammar bitmask applied to logits: the Triton kernel against the vectorized torch
path, and that path against the bitmask's definition, token by token."""

from __future__ import annotations

import pytest
import torch

from cadence.engine.structured_output.bitmask import allowed_tokens, apply_token_bitmask_reference, bitmask_width
from cadence.kernels.triton.token_bitmask import apply_token_bitmask
from tests.support.helpers import DEVICE, gen


def random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    words = torch.randint(-(2**31), 2**31, (rows, bitmask_width(vocab)), generator=gen(seed), dtype=torch.int64)
    return words.to(torch.int32)


@pytest.mark.parametrize("vocab", [31, 32, 100, 1000])
def test_allowed_tokens_reads_bit_t_of_word_t_div_32(vocab: int) -> None:
    bitmask = random_bitmask(3, vocab, seed=vocab)
    allowed = allowed_tokens(bitmask, vocab)
    for row in range(3):
        expected = [bool((int(bitmask[row, t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
        assert allowed[row].tolist() == expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch,vocab,rows", [(1, 40, [0]), (5, 1000, [4, 0, 2]), (3, 2500, [1])])
def test_kernel_matches_the_torch_path(dtype: torch.dtype, batch: int, vocab: int, rows: list[int]) -> None:
    logits = torch.randn(batch, vocab, generator=gen(batch)).to(dtype)
    bitmask = random_bitmask(len(rows), vocab, seed=vocab)
    row_index = torch.tensor(rows, dtype=torch.int64)
    expected = logits.clone()
    apply_token_bitmask_reference(expected, bitmask, row_index)
    out = logits.to(DEVICE)
    apply_token_bitmask(out, bitmask.to(DEVICE), row_index.to(DEVICE))
    assert torch.equal(out.cpu(), expected)
    # Rows without a mask are untouched, and masked rows keep exactly their allowed logits.
    untouched = [r for r in range(batch) if r not in rows]
    assert torch.equal(expected[untouched], logits[untouched])
    allowed = allowed_tokens(bitmask, vocab)
    for i, r in enumerate(rows):
        assert torch.equal(expected[r][allowed[i]], logits[r][allowed[i]])
        assert bool((expected[r][~allowed[i]] == float("-inf")).all())
