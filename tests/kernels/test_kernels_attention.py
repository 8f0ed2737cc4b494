"""The paged-attention and KV-cache-write Triton kernels against their torch references.

Without CUDA the kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest sets it
before anything imports triton; slow, so the shapes are tiny). Tolerances are relative
Frobenius errors ||out - ref|| / ||ref||: fp32 1e-5, fp16 2e-3. Outputs are poisoned
with NaN first, and cache slots that hold no context are NaN too, so an unwritten output
or a read past a sequence's end fails.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cadence.kernels.formats import kv_quant
from cadence.kernels.triton import kv_cache_write
from cadence.kernels.triton import paged_attention as pa
from tests.support.helpers import DEVICE, KERNEL_TOL, rel_err

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def make_batch(
    q_lens: list[int],
    ctx_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int,
) -> Batch:
    """Random q and a paged cache whose blocks are scattered; unused slots hold NaN.

    Returns `(q, kv_cache, block_tables, seq_lens, query_start_loc)`.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.zeros(len(seq_lens), max(blocks_per_seq) + 1, dtype=torch.int32)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    used = 0
    for s, (n, seq_len) in enumerate(zip(blocks_per_seq, seq_lens)):
        ids = perm[used : used + n]
        used += n
        block_tables[s, :n] = ids
        pos = torch.arange(seq_len)
        kv_cache[:, ids[pos // block_size], pos % block_size] = torch.randn(
            2, seq_len, num_kv_heads, head_dim, generator=gen
        )
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    starts = torch.tensor([0] + q_lens).cumsum(0).to(torch.int32)
    return (
        q.to(DEVICE, dtype),
        kv_cache.to(DEVICE, dtype),
        block_tables.to(DEVICE),
        torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        starts.to(DEVICE),
    )


def run_kernel(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    starts: torch.Tensor,
    max_q: int,
    scale: float,
    window: int | None,
    num_splits: int | None,
    **kw: Any,
) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))
    return pa.paged_attention(
        q,
        kv_cache,
        block_tables,
        seq_lens,
        starts,
        max_q,
        scale,
        window=window,
        num_splits=num_splits,
        out=out,
        **kw,
    )


# (dtype, group, head_dim, block_size, window): every axis value appears at least once.
CASES = [
    (torch.float32, 1, 16, 4, None),
    (torch.float32, 4, 32, 8, 5),
    (torch.float16, 4, 16, 16, None),
    (torch.float16, 1, 32, 4, 7),
    (torch.float32, 4, 16, 16, 3),
    (torch.float32, 3, 16, 8, None),  # a group that is not a power of two
]


@pytest.mark.parametrize("dtype,group,head_dim,block_size,window", CASES)
def test_mixed_batch_matches_reference_split_and_unsplit(
    dtype: torch.dtype, group: int, head_dim: int, block_size: int, window: int | None
) -> None:
    # Decodes of varied context first, then prefill chunks: one fresh, one with a cached
    # prefix and more query tokens than one query tile holds.
    q_lens = [1, 1, 1, 6, 19]
    ctx_lens = [0, 9, 70, 0, 45]
    seed = hash((str(dtype), group, head_dim, block_size, window)) % 2**31
    inputs = make_batch(q_lens, ctx_lens, 2, group, head_dim, block_size, dtype, seed)
    scale = head_dim**-0.5
    ref = pa.reference(*inputs, scale, window=window)
    unsplit = run_kernel(*inputs, max(q_lens), scale, window, 1)
    tol = KERNEL_TOL[dtype]
    assert rel_err(unsplit, ref) < tol
    for num_splits in (3, 8):  # 8 leaves some splits with no KV tile at all
        split = run_kernel(*inputs, max(q_lens), scale, window, num_splits)
        assert rel_err(split, ref) < tol
        assert rel_err(split, unsplit) < tol


@pytest.mark.parametrize("window", [None, 20])
def test_long_decode_splits_automatically(window: int | None) -> None:
    q_lens, ctx_lens = [1, 1], [611, 300]
    inputs = make_batch(q_lens, ctx_lens, 1, 4, 16, 16, torch.float32, 7)
    assert pa.choose_num_splits(2, 1, 612, 16) > 1
    ref = pa.reference(*inputs, 0.25, window=window)
    out = run_kernel(*inputs, 1, 0.25, window, None, num_sms=16)
    assert rel_err(out, ref) < KERNEL_TOL[torch.float32]


def test_choose_num_splits_follows_idle_sms_and_context() -> None:
    # Enough programs to fill the machine: never split.
    assert pa.choose_num_splits(256, 8, 32768, 132) == 1
    # One sequence, one KV head, long context: fill the SMs, up to the cap.
    assert pa.choose_num_splits(1, 1, 32768, 132) == 32
    assert pa.choose_num_splits(2, 8, 32768, 132) == 9  # cdiv(132, 16)
    # Short contexts are not worth splitting however idle the machine is.
    assert pa.choose_num_splits(1, 1, 300, 132) == 1
    assert pa.choose_num_splits(1, 1, 1024, 132) == 4  # 256 positions per split at least
    # More SMs never means fewer splits.
    counts = [pa.choose_num_splits(4, 2, 8192, sms) for sms in (8, 16, 64, 132)]
    assert counts == sorted(counts)


def test_reference_matches_sdpa_on_gathered_dense_kv() -> None:
    q_lens, ctx_lens, group, head_dim, block_size, window = [7], [10], 4, 16, 4, 6
    q, kv_cache, block_tables, seq_lens, starts = make_batch(
        q_lens, ctx_lens, 2, group, head_dim, block_size, torch.float32, 3
    )
    seq_len = int(seq_lens[0])
    pos = torch.arange(seq_len, device=DEVICE)
    blocks = block_tables[0].long()[pos // block_size]
    keys = kv_cache[0, blocks, pos % block_size].transpose(0, 1)  # [Hkv, L, D]
    values = kv_cache[1, blocks, pos % block_size].transpose(0, 1)
    q_pos = torch.arange(ctx_lens[0], seq_len, device=DEVICE)[:, None]
    for w in (None, window):
        mask = pos[None, :] <= q_pos
        if w is not None:
            mask &= pos[None, :] > q_pos - w
        expected = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),
            keys.unsqueeze(0),
            values.unsqueeze(0),
            attn_mask=mask,
            scale=0.3,
            enable_gqa=True,
        )[0].transpose(0, 1)
        ref = pa.reference(q, kv_cache, block_tables, seq_lens, starts, 0.3, window=w)
        assert rel_err(ref, expected) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_cache(dtype: torch.dtype) -> None:
    num_blocks, block_size, heads, head_dim = 5, 4, 3, 16  # 3 heads: padded to 4 in-kernel
    gen = torch.Generator().manual_seed(11)
    k = torch.randn(6, heads, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(6, heads, head_dim, generator=gen).to(DEVICE, dtype)
    slots = torch.tensor([13, -1, 0, 7, -1, 19], device=DEVICE)
    cache = torch.full((2, num_blocks, block_size, heads, head_dim), float("nan"), dtype=dtype, device=DEVICE)
    expected = cache.clone()
    kv_cache_write.reference(k, v, expected, slots)
    kv_cache_write.write_kv_cache(k, v, cache, slots)
    assert torch.equal(cache.nan_to_num(-7.0), expected.nan_to_num(-7.0))
    flat = cache.view(2, -1, heads, head_dim)
    written = [13, 0, 7, 19]
    assert torch.equal(flat[0, written], k[[0, 2, 3, 5]]) and torch.equal(flat[1, written], v[[0, 2, 3, 5]])
    untouched = [s for s in range(num_blocks * block_size) if s not in written]
    assert flat[:, untouched].isnan().all()
    # int32 slots, and non-contiguous k/v (views of a fused qkv) work too.
    qkv = torch.randn(6, 3 * heads, head_dim, generator=gen).to(DEVICE, dtype)
    k2, v2 = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]
    kv_cache_write.write_kv_cache(k2, v2, cache, slots.to(torch.int32))
    kv_cache_write.reference(k2, v2, expected, slots)
    assert torch.equal(cache.nan_to_num(-7.0), expected.nan_to_num(-7.0))


def test_write_then_attend_roundtrip() -> None:
    """The two kernels together, as a backend would call them for one step."""
    q_lens, ctx_lens, block_size = [1, 5], [6, 3], 4
    q, kv_cache, block_tables, seq_lens, starts = make_batch(q_lens, ctx_lens, 2, 2, 16, block_size, torch.float32, 5)
    truth = kv_cache.clone()
    slot_ids = []
    for s, (c, n) in enumerate(zip(ctx_lens, q_lens)):
        for p in range(c, c + n):
            slot_ids.append(int(block_tables[s, p // block_size]) * block_size + p % block_size)
    slots = torch.tensor(slot_ids, device=DEVICE)
    flat = truth.view(2, -1, *truth.shape[3:])
    new_k, new_v = flat[0, slots].clone(), flat[1, slots].clone()
    kv_cache.view(2, -1, *truth.shape[3:])[:, slots] = float("nan")  # forget the new tokens
    kv_cache_write.write_kv_cache(new_k, new_v, kv_cache, slots)
    # int64 metadata, as StepBatch holds it.
    meta = block_tables.long(), seq_lens.long(), starts.long()
    out = run_kernel(q, kv_cache, *meta, max(q_lens), 0.25, None, None)
    ref = pa.reference(q, truth, *meta, 0.25)
    assert rel_err(out, ref) < KERNEL_TOL[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compiled_realistic_shapes(dtype: torch.dtype) -> None:
    q_lens = [1] * 6 + [70, 300]
    ctx_lens = [5, 100, 700, 1500, 33, 4000, 0, 250]
    inputs = make_batch(q_lens, ctx_lens, 8, 4, 128, 16, dtype, 1)
    ref = pa.reference(*inputs, 128**-0.5, window=None)
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2
    for num_splits in (1, 4, None):
        out = run_kernel(*inputs, max(q_lens), 128**-0.5, None, num_splits)
        assert rel_err(out, ref) < tol
    out = run_kernel(*inputs, max(q_lens), 128**-0.5, 256, None)
    assert rel_err(out, pa.reference(*inputs, 128**-0.5, window=256)) < tol


def quantize_cache(kv_cache: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A quantized copy of a float cache; slots that hold no context get NaN scales."""
    stored, scales = kv_quant.quantize_rows(torch.nan_to_num(kv_cache.float()), dtype)
    scales[kv_cache.isnan().any(dim=-1)] = float("nan")
    return stored, scales.contiguous()


@pytest.mark.parametrize("dtype,group,window", [(torch.float32, 4, None), (torch.float16, 1, 7)])
def test_int8_kv_cache_matches_reference_and_dense(dtype: torch.dtype, group: int, window: int | None) -> None:
    q_lens, ctx_lens = [1, 1, 6, 19], [9, 70, 0, 45]
    q, kv_cache, block_tables, seq_lens, starts = make_batch(q_lens, ctx_lens, 2, group, 16, 8, dtype, 11)
    stored, scales = quantize_cache(kv_cache, torch.int8)
    scale = 16**-0.5
    ref = pa.reference(q, stored, block_tables, seq_lens, starts, scale, window=window, kv_scales=scales)
    for num_splits in (1, 3):
        out = run_kernel(
            q, stored, block_tables, seq_lens, starts, max(q_lens), scale, window, num_splits, kv_scales=scales
        )
        assert rel_err(out, ref) < KERNEL_TOL[dtype]
    # Against the unquantized cache: int8 with a scale per row keeps attention within ~1%.
    dense = pa.reference(q, kv_cache, block_tables, seq_lens, starts, scale, window=window)
    assert rel_err(ref, dense) < 1e-2


def test_int8_kv_cache_write_matches_reference() -> None:
    num_tokens, heads, dim, blocks, block_size = 6, 2, 16, 5, 4
    gen = torch.Generator().manual_seed(5)
    k = torch.randn(num_tokens, heads, dim, generator=gen)
    v = 3 * torch.randn(num_tokens, heads, dim, generator=gen)
    slots = torch.tensor([0, 7, -1, 9, 18, 3])
    cache = torch.zeros(2, blocks, block_size, heads, dim, dtype=torch.int8, device=DEVICE)
    scales = torch.full((2, blocks, block_size, heads), float("nan"), device=DEVICE)
    ref_cache, ref_scales = cache.cpu(), scales.cpu()
    kv_cache_write.write_kv_cache(k.to(DEVICE), v.to(DEVICE), cache, slots.to(DEVICE), scales)
    kv_cache_write.reference(k, v, ref_cache, slots, ref_scales)
    cache, scales = cache.cpu(), scales.cpu()
    written = slots[slots >= 0]
    flat_scales, flat_ref = scales.reshape(2, -1, heads), ref_scales.reshape(2, -1, heads)
    # A GPU divides in the kernel with a last-bit difference from torch on the CPU (seen
    # on an H100), which may move a code at a rounding tie by one.
    exact = DEVICE == "cpu"
    torch.testing.assert_close(flat_scales[:, written], flat_ref[:, written], rtol=0 if exact else 1e-6, atol=0)
    assert int((cache.int() - ref_cache.int()).abs().max()) <= (0 if exact else 1)
    untouched = torch.ones(blocks * block_size, dtype=torch.bool)
    untouched[written] = False
    assert flat_scales[:, untouched].isnan().all(), "skipped and unused slots keep their poison"
    dequantized = (cache.float() * scales[..., None]).reshape(2, -1, heads, dim)[:, written]
    assert rel_err(dequantized[0], k[slots >= 0]) < 1e-2


def test_fp8_kv_cache_reference_write_is_torchs_own_cast(monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 cache on a GPU without fp8 (A100) is written by `reference`, through a uint8
    view: the bytes must be exactly those of torch's own e4m3 cast of the scaled rows."""
    num_tokens, heads, dim, blocks, block_size = 5, 2, 16, 4, 4
    gen = torch.Generator().manual_seed(6)
    k = torch.randn(num_tokens, heads, dim, generator=gen)
    v = 5 * torch.randn(num_tokens, heads, dim, generator=gen)
    slots = torch.tensor([2, -1, 9, 0, 15])
    cache = torch.zeros(2, blocks, block_size, heads, dim, dtype=torch.float8_e4m3fn)
    scales = torch.full((2, blocks, block_size, heads), float("nan"))
    monkeypatch.setattr(kv_cache_write, "_kernel_writes", lambda kv_cache: False)
    kv_cache_write.write_kv_cache(k, v, cache, slots, scales)
    keep = slots >= 0
    for index, x in enumerate((k[keep], v[keep])):
        values, row_scales = kv_quant.quantize_rows(x, torch.float8_e4m3fn)
        stored = cache[index].reshape(-1, heads, dim)[slots[keep]]
        assert torch.equal(stored.view(torch.uint8), values.view(torch.uint8))
        assert torch.equal(scales[index].reshape(-1, heads)[slots[keep]], row_scales)
