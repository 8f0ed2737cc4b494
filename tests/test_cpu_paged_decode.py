"""The CPU paged decode kernel (engine/attention/cpu_paged_decode.py) and how the torch
backend routes rows to it.

The kernel against float64 attention over the same blocks (grouped query heads, windows,
head sizes that do not fill a vector, lengths across block edges); a row's bits alone and
among others; and in the backend: generated tokens' rows go to the kernel (a recomputed
request's included, with the bits its decode had), prompt tokens' rows to SDPA, and an
engine turns the kernel on only where it serves.
"""

from __future__ import annotations

import pytest
import torch

from cadence import LLM
from cadence.engine.attention import cpu_paged_decode
from cadence.engine.attention.backend import AttentionSpec, StepBatch
from cadence.engine.attention.cpu_paged_decode import GeneratedRows, attend_generated
from cadence.engine.attention.torch_sdpa import TorchSDPABackend

pytestmark = pytest.mark.skipif(not cpu_paged_decode.available(), reason="numba cannot build the kernel here")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _reference(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: int, end: int, scale: float
) -> torch.Tensor:
    """One row's attention in float64: ``query [H, D]`` over positions [first, end) of a
    sequence's ``keys`` / ``values`` ``[positions, KV, D]``."""
    heads, kv_heads = query.shape[0], keys.shape[1]
    k = keys[first:end].double().repeat_interleave(heads // kv_heads, dim=1)  # [L, H, D]
    v = values[first:end].double().repeat_interleave(heads // kv_heads, dim=1)
    weights = torch.softmax(torch.einsum("hd,lhd->hl", query.double() * scale, k), dim=-1)
    return torch.einsum("hl,lhd->hd", weights, v)


def _cache_with_sequences(
    lengths: list[int], kv_heads: int, dim: int, block_size: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """K and V caches ``[slots, KV, D]`` holding sequences of ``lengths`` in shuffled
    blocks; their block tables ``[seqs, max_blocks]`` (int32, padded with 0), and each
    sequence's keys and values in position order."""
    gen = _gen(seed)
    blocks_each = [-(-n // block_size) for n in lengths]
    num_blocks = sum(blocks_each) + 3
    order = torch.randperm(num_blocks - 1, generator=gen) + 1  # block 0 is never a sequence's
    k_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen) * 3
    v_cache = torch.randn(num_blocks * block_size, kv_heads, dim, generator=gen)
    tables = torch.zeros(len(lengths), max(blocks_each), dtype=torch.int32)
    keys, values, used = [], [], 0
    for i, (n, count) in enumerate(zip(lengths, blocks_each)):
        ids = order[used : used + count]
        used += count
        tables[i, :count] = ids.to(torch.int32)
        slots = (ids[:, None] * block_size + torch.arange(block_size)).flatten()[:n]
        keys.append(k_cache[slots])
        values.append(v_cache[slots])
    return k_cache, v_cache, tables, keys, values


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size,window",
    [(9, 3, 64, 16, None), (4, 4, 24, 4, None), (8, 2, 32, 16, 7), (6, 1, 16, 8, 40)],
)
def test_kernel_matches_float64_attention(heads: int, kv_heads: int, dim: int, block_size: int, window: int | None):
    lengths = [1, 15, 16, 17, 100, 3, 64]
    k_cache, v_cache, tables, keys, values = _cache_with_sequences(lengths, kv_heads, dim, block_size, seed=1)
    query = torch.randn(len(lengths) + 2, heads, dim, generator=_gen(2))  # rows 0 and 1 are not asked for
    rows = list(range(2, len(lengths) + 2))
    out = torch.full_like(query, 7.0)
    scale = dim**-0.5
    generated = GeneratedRows.build(rows, tables, [n - 1 for n in lengths], window)
    attend_generated(query, out, k_cache, v_cache, generated, block_size, scale)
    assert torch.equal(out[:2], torch.full_like(out[:2], 7.0))  # other rows untouched
    for row, n, k, v in zip(rows, lengths, keys, values):
        first = max(n - window, 0) if window is not None else 0
        expected = _reference(query[row], k, v, first, n, scale)
        torch.testing.assert_close(out[row].double(), expected, rtol=1e-5, atol=1e-5)


def test_a_rows_bits_do_not_depend_on_the_others():
    """Alone, among other rows of other lengths, and in another order: the same bits."""
    lengths = [150, 7, 300, 33, 150, 1]
    k_cache, v_cache, tables, _, _ = _cache_with_sequences(lengths, 3, 64, 16, seed=3)
    query = torch.randn(len(lengths), 9, 64, generator=_gen(4))
    positions = [n - 1 for n in lengths]

    def attend(rows: list[int]) -> torch.Tensor:
        out = torch.zeros_like(query)
        generated = GeneratedRows.build(rows, tables[rows], [positions[r] for r in rows], None)
        attend_generated(query, out, k_cache, v_cache, generated, 16, 0.125)
        return out

    together = attend(list(range(len(lengths))))
    backwards = attend(list(reversed(range(len(lengths)))))
    for row in range(len(lengths)):
        alone = attend([row])
        assert torch.equal(alone[row], together[row]) and torch.equal(alone[row], backwards[row])


SPEC = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=16, scale=0.25)
BLOCK = 4


def _backend() -> TorchSDPABackend:
    backend = TorchSDPABackend(SPEC, BLOCK)
    assert backend.use_paged_decode(torch.device("cpu"), torch.float32)
    return backend


def _step(
    backend: TorchSDPABackend,
    cache: torch.Tensor,
    table: torch.Tensor,
    context_len: int,
    qkv: tuple[torch.Tensor, ...],
    positions: range,
    prompt_len: int,
):
    """One sequence adds ``positions`` (its rows of ``qkv``) on ``cache``: the metadata and output."""
    q, k, v = (t[positions.start : positions.stop] for t in qkv)
    slots = table[torch.tensor(list(positions)) // BLOCK].long() * BLOCK + torch.tensor(list(positions)) % BLOCK
    batch = StepBatch(
        query_starts=[0],
        query_lens=[len(positions)],
        context_lens=[context_len],
        block_tables=table[None],
        num_decodes=int(len(positions) == 1),
        slot_mapping=slots,
        prompt_lens=[prompt_len],
    )
    metadata = backend.build_metadata(batch)
    return metadata, backend.forward(q, k, v, cache, metadata)


def test_backend_routes_rows_by_token_kind_and_a_recompute_keeps_the_decode_bits():
    backend = _backend()
    gen = _gen(5)
    length, prompt_len = 12, 7
    qkv = tuple(torch.randn(length, n, 16, generator=gen) for n in (4, 2, 2))
    table = torch.tensor([3, 1, 4], dtype=torch.int32)
    cache = torch.zeros(2, 6, BLOCK, 2, 16)

    # The prompt in one chunk, then each generated token decoded: SDPA, then the kernel.
    metadata, _ = _step(backend, cache, table, 0, qkv, range(prompt_len), prompt_len)
    assert metadata.generated is None and sum(c.query_len for c in metadata.prefills) == prompt_len
    decoded = {}
    for position in range(prompt_len, length):
        metadata, out = _step(backend, cache, table, position, qkv, range(position, position + 1), prompt_len)
        assert metadata.decode_groups == [] and metadata.generated is not None
        assert metadata.generated.rows.tolist() == [0] and metadata.generated.lengths.tolist() == [position + 1]
        decoded[position] = out[0]

    # Preempted and recomputed from position 3: the prompt's rows to SDPA, the generated
    # tokens' to the kernel, each with the bits its decode had.
    recomputed = torch.zeros_like(cache)
    _step(backend, recomputed, table, 0, qkv, range(3), prompt_len)
    metadata, out = _step(backend, recomputed, table, 3, qkv, range(3, length), prompt_len)
    assert sum(c.query_len for c in metadata.prefills) == prompt_len - 3
    assert metadata.generated is not None and metadata.generated.rows.tolist() == list(range(prompt_len - 3, 9))
    for position in range(prompt_len, length):
        assert torch.equal(out[position - 3], decoded[position]), position

    # A prompt's one-token chunk is a prompt token's row: SDPA, not the kernel.
    metadata, _ = _step(backend, recomputed, table, 6, qkv, range(6, 7), prompt_len)
    assert metadata.generated is None and len(metadata.decode_groups) == 1


def test_the_kernel_serves_only_float32_attention_over_a_plain_cache(monkeypatch, tiny_model_dir):
    cpu = torch.device("cpu")
    assert not TorchSDPABackend(SPEC, BLOCK).splits_generated_rows  # off until asked for
    assert not TorchSDPABackend(SPEC, BLOCK).use_paged_decode(cpu, None)  # a quantized cache
    assert not TorchSDPABackend(SPEC, BLOCK, torch.bfloat16).use_paged_decode(cpu, torch.bfloat16)
    assert not TorchSDPABackend(SPEC, BLOCK).use_paged_decode(torch.device("meta"), torch.float32)

    engine = {"dtype": "float32", "max_model_len": 128, "num_gpu_blocks": 32}
    plain = LLM(tiny_model_dir("llama"), **engine).engine.runner
    assert plain.backend.splits_generated_rows and plain.splits_prompt_rows
    quantized_cache = LLM(tiny_model_dir("llama"), kv_cache_dtype="int8", **engine).engine.runner
    assert not quantized_cache.backend.splits_generated_rows and not quantized_cache.splits_prompt_rows

    # Without numba, every row goes through SDPA as before.
    monkeypatch.setattr(cpu_paged_decode, "_compiled", lambda: None)
    assert not TorchSDPABackend(SPEC, BLOCK).use_paged_decode(cpu, torch.float32)
