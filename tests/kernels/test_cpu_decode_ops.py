"""The CPU decode shortcuts against what they replace, bit for bit.

RoPE: the per-pass factors and the roll-based rotation (kernels/layer_ops_reference.py,
engine/models/rotary.py) against the per-half formula they replaced. Decode attention
(engine/attention/torch_sdpa.py): a CPU group's float mask over its padded keys, a row
that reads the same beside a longer one, and each KV head's query heads going in as its
query rows, checked head by head against fp64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cadence.engine.attention import torch_sdpa
from cadence.engine.attention.backend import AttentionSpec, KVCache, QuantizedKVCache, StepBatch
from cadence.engine.attention.torch_sdpa import TorchSDPABackend
from cadence.engine.models.rotary import RotaryEmbedding
from cadence.kernels import layer_ops_reference as reference
from cadence.kernels.formats.kv_quant import KV_CACHE_DTYPES, quantize_rows

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64  # SmolLM2-135M's attention
BLOCK_SIZE = 4


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _per_half_rotary(positions: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The formula the rotation had before: each half's products and sum rounded to x's dtype."""
    c = cos[positions].unsqueeze(1).to(x.dtype)
    s = sin[positions].unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


def _q_and_k(tokens: int, dtype: torch.dtype, fused: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] and k [T, KV, D]: strided views of one fused qkv output, as the model
    passes them, or separate contiguous tensors. Magnitudes span a few decades."""
    width = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    qkv = (torch.randn(tokens, width, generator=_gen(seed)) * torch.logspace(-2, 2, width)).to(dtype)
    q, k, _ = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    q, k = q.view(tokens, HEADS, HEAD_DIM), k.view(tokens, KV_HEADS, HEAD_DIM)
    return (q, k) if fused else (q.contiguous(), k.contiguous())


def _tables(rotary: RotaryEmbedding, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rotary.build(positions.device)
    assert rotary.cos is not None and rotary.sin is not None
    return rotary.cos, rotary.sin


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("positions", [[41], [0, 3, 2047, 7, 7, 500]])
def test_rotary_is_bit_identical_to_the_per_half_formula(dtype: torch.dtype, fused: bool, positions: list[int]) -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 2048, 100000.0)
    pos = torch.tensor(positions)
    q, k = _q_and_k(len(positions), dtype, fused, seed=len(positions))
    q_before, k_before = q.clone(), k.clone()
    expected_q = _per_half_rotary(pos, q, *_tables(rotary, pos))
    expected_k = _per_half_rotary(pos, k, *_tables(rotary, pos))

    got_q, got_k = reference.rotary(pos, q, k, *_tables(rotary, pos))
    assert torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    rope = rotary.at(pos)
    for _ in range(2):  # the second call, as the next layer, reuses the gathered factors
        got_q, got_k = rope(q, k)
        assert got_q.dtype == dtype and torch.equal(got_q, expected_q) and torch.equal(got_k, expected_k)
    assert torch.equal(q, q_before) and torch.equal(k, k_before)  # CPU rotary returns copies


def test_one_pass_rotates_each_dtype_with_factors_rounded_to_it() -> None:
    rotary = RotaryEmbedding(HEAD_DIM, 2048, 10000.0)
    pos = torch.tensor([5, 1999])
    rope = rotary.at(pos)
    for dtype in DTYPES:  # factors cached for one dtype must not serve another
        q, k = _q_and_k(2, dtype, fused=True, seed=9)
        got_q, got_k = rope(q, k)
        assert torch.equal(got_q, _per_half_rotary(pos, q, *_tables(rotary, pos)))
        assert torch.equal(got_k, _per_half_rotary(pos, k, *_tables(rotary, pos)))


def _decode_batch(context_lens: list[int]) -> StepBatch:
    """Decodes of sequences with these cached lengths, each in its own run of blocks."""
    widths = [n // BLOCK_SIZE + 1 for n in context_lens]
    tables = torch.zeros(len(context_lens), max(widths), dtype=torch.long)
    first = 0
    for row, width in enumerate(widths):
        tables[row, :width] = torch.arange(first, first + width)
        first += width
    slots = [int(tables[row, n // BLOCK_SIZE]) * BLOCK_SIZE + n % BLOCK_SIZE for row, n in enumerate(context_lens)]
    return StepBatch(
        query_starts=list(range(len(context_lens))),
        query_lens=[1] * len(context_lens),
        context_lens=context_lens,
        block_tables=tables,
        num_decodes=len(context_lens),
        slot_mapping=torch.tensor(slots),
    )


def _backend(window: int | None = None) -> TorchSDPABackend:
    return TorchSDPABackend(AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, window), BLOCK_SIZE)


def _expected_mask(backend: TorchSDPABackend, context_lens: list[int], window: int | None) -> torch.Tensor:
    """Which keys each decode sees, over the padded key length (padding is never seen)."""
    lens = torch.tensor(context_lens)[:, None] + 1
    positions = torch.arange(backend.invariant.kv_len(int(lens.max())))[None, :]
    mask = positions < lens
    if window is not None:
        mask &= positions >= lens - window
    return mask[:, None, None, :]


@pytest.mark.parametrize(
    "context_lens,window",
    [([40], None), ([7, 7, 7], None), ([5, 8], None), ([20, 33, 33], None), ([40], 40), ([12, 20], 10), ([300], None)],
)
def test_cpu_decode_group_mask_is_additive_over_the_padded_keys(context_lens: list[int], window: int | None) -> None:
    """Every CPU decode group carries a float mask (0 = attend, -inf = not) over its keys
    padded to ``InvariantShape.kv_len``, and reads that many positions in whole blocks."""
    backend = _backend(window)
    (group,) = backend.build_metadata(_decode_batch(context_lens)).decode_groups
    expected = _expected_mask(backend, context_lens, window)
    assert group.attn_mask.dtype == torch.float32
    assert torch.equal(group.attn_mask == 0, expected)
    assert bool((group.attn_mask[~expected] == float("-inf")).all())
    blocks = group.gather_blocks
    assert group.gather_slots is None and blocks is not None and blocks.length == expected.shape[-1]
    assert blocks.block_ids.shape == (len(context_lens), -(-expected.shape[-1] // BLOCK_SIZE))


def _decode_inputs(rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """A filled cache, then query, key and value for `rows` decodes."""
    cache = torch.randn(2, 32, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=_gen(1)).to(dtype)
    query = torch.randn(rows, HEADS, HEAD_DIM, generator=_gen(2)).to(dtype)
    key = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=_gen(3)).to(dtype)
    value = torch.randn(rows, KV_HEADS, HEAD_DIM, generator=_gen(4)).to(dtype)
    return cache, query, key, value


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("context_lens", [[40], [17, 17]])
def test_decode_reads_the_same_alone_and_beside_a_longer_row(dtype: torch.dtype, context_lens: list[int]) -> None:
    """A longer row in the group pads the keys further; no bit of the others changes."""
    backend = TorchSDPABackend(AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5), BLOCK_SIZE, dtype)
    cache, query, key, value = _decode_inputs(len(context_lens) + 1, dtype)
    alone = backend.forward(
        query[:-1], key[:-1], value[:-1], cache.clone(), backend.build_metadata(_decode_batch(context_lens))
    )
    together = backend.forward(
        query, key, value, cache.clone(), backend.build_metadata(_decode_batch([*context_lens, 70]))
    )
    assert torch.equal(alone, together[:-1])


def _cache_as(cache: torch.Tensor, kv_cache_dtype: str) -> KVCache:
    """The random cache as stored: plain, or quantized rows with their scales."""
    if kv_cache_dtype == "auto":
        return cache
    stored, scales = quantize_rows(cache, KV_CACHE_DTYPES[kv_cache_dtype])
    return QuantizedKVCache(stored, scales)


def _copy(cache: KVCache) -> KVCache:
    if isinstance(cache, QuantizedKVCache):
        return QuantizedKVCache(cache.values.clone(), cache.scales.clone())
    return cache.clone()


@pytest.mark.parametrize("part_rows", [1, 2])
@pytest.mark.parametrize(
    "dtype,kv_cache_dtype,window",
    [
        (torch.float32, "auto", None),
        (torch.bfloat16, "auto", None),
        (torch.float32, "int8", None),
        (torch.float32, "auto", 7),
    ],
)
def test_decode_group_read_in_parts_gives_the_whole_groups_bits(
    monkeypatch: pytest.MonkeyPatch, part_rows: int, dtype: torch.dtype, kv_cache_dtype: str, window: int | None
) -> None:
    """A big decode group is gathered and attended a few rows at a time; every row keeps
    the bits one call over the whole group gives it."""
    context_lens = [5, 9, 9, 12, 6, 7, 8, 5, 10, 11]
    backend = TorchSDPABackend(AttentionSpec(HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, window), BLOCK_SIZE, dtype)
    plain, query, key, value = _decode_inputs(len(context_lens), dtype)
    cache = _cache_as(plain, kv_cache_dtype)
    metadata = backend.build_metadata(_decode_batch(context_lens))
    (group,) = metadata.decode_groups
    whole = backend.forward(query, key, value, _copy(cache), metadata)
    assert group.gather_blocks is not None
    row_bytes = 2 * group.gather_blocks.length * KV_HEADS * HEAD_DIM * query.element_size()
    monkeypatch.setattr(torch_sdpa, "_DECODE_PART_BYTES", part_rows * row_bytes)
    calls: list[int] = []
    attend = torch_sdpa.decode_attention

    def counted(query: torch.Tensor, *rest: Any) -> torch.Tensor:
        calls.append(query.shape[0])
        return attend(query, *rest)

    monkeypatch.setattr(torch_sdpa, "decode_attention", counted)
    parts = backend.forward(query, key, value, _copy(cache), backend.build_metadata(_decode_batch(context_lens)))
    # At least enough rows that every thread has a (row, KV head) to work on.
    step = max(part_rows, -(-torch.get_num_threads() // KV_HEADS))
    whole_parts, rest_rows = divmod(len(context_lens), step)
    assert calls == [step] * whole_parts + [rest_rows] * (rest_rows > 0)
    assert len(calls) > 1  # parts, not the whole group
    assert torch.equal(parts, whole)


def test_cpu_attention_skips_the_cuda_backend_context(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("CPU attention entered the sdpa_kernel context, which only CUDA needs")

    monkeypatch.setattr(torch_sdpa, "sdpa_kernel", refuse)
    backend = _backend()
    metadata = backend.build_metadata(_decode_batch([9, 12]))
    cache, query, key, value = _decode_inputs(2, torch.float32)
    assert backend.forward(query, key, value, cache, metadata).shape == query.shape


def _decode_by_heads(
    cache: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, context_lens: list[int]
) -> torch.Tensor:
    """Each row, each query head on its own against its KV head (h // group), in fp64."""
    cache = cache.clone()
    batch = _decode_batch(context_lens)
    flat = cache.view(2, -1, KV_HEADS, HEAD_DIM)
    flat[0, batch.slot_mapping], flat[1, batch.slot_mapping] = key, value
    out = torch.empty(query.shape, dtype=torch.float64)
    for row, n in enumerate(context_lens):
        slots = (
            batch.block_tables[row, torch.arange(n + 1) // BLOCK_SIZE] * BLOCK_SIZE + torch.arange(n + 1) % BLOCK_SIZE
        )
        for head in range(HEADS):
            k = flat[0, slots, head // (HEADS // KV_HEADS)].double()
            v = flat[1, slots, head // (HEADS // KV_HEADS)].double()
            weights = torch.softmax(k @ query[row, head].double() * HEAD_DIM**-0.5, dim=0)
            out[row, head] = weights @ v
    return out


@pytest.mark.parametrize("layout", ["contiguous", "heads inner"])
def test_decode_folds_each_kv_heads_query_heads_into_its_rows(monkeypatch: pytest.MonkeyPatch, layout: str) -> None:
    """Query head h reads KV head h // group; with "heads inner" SDPA returns its result
    laid out as CUDA's memory-efficient kernel does (rows and heads swapped in memory)."""
    if layout == "heads inner":
        sdpa = torch_sdpa.F.scaled_dot_product_attention

        def swapped(*args: Any, **kwargs: Any) -> torch.Tensor:  # passes SDPA's arguments through
            out = sdpa(*args, **kwargs)
            return out.transpose(1, 2).contiguous().transpose(1, 2)

        monkeypatch.setattr(torch_sdpa.F, "scaled_dot_product_attention", swapped)
    context_lens = [5, 9, 9]  # padded: one group with a mask
    backend = _backend()
    cache, query, key, value = _decode_inputs(len(context_lens), torch.float32)
    got = backend.forward(query, key, value, cache.clone(), backend.build_metadata(_decode_batch(context_lens)))
    expected = _decode_by_heads(cache, query, key, value, context_lens)
    assert torch.allclose(got.double(), expected, atol=1e-5, rtol=1e-5)
