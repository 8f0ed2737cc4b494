"""The CPU paged decode kernel (kernels/cpu/paged_decode.py) and how the torch
backend routes rows to it.

The kernel against float64 attention over the same blocks (grouped query heads, windows,
head sizes that do not fill a vector, lengths across block edges); a row's bits alone and
among others; and in the backend: generated tokens' rows go to the kernel (a recomputed
request's included, with the bits its decode had), prompt tokens' rows to SDPA, and an
engine turns the kernel on only where it serves.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from cadence import LLM
from cadence.engine.attention.backend import AttentionSpec, StepBatch
from cadence.engine.attention.torch_sdpa import TorchSDPABackend, TorchSDPAMetadata
from cadence.kernels.cpu import paged_decode
from cadence.kernels.cpu.paged_decode import GeneratedRows, attend_generated
from tests.support.helpers import run_python

pytestmark = pytest.mark.skipif(not paged_decode.available(), reason="numba cannot build the kernel here")


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
def test_kernel_matches_float64_attention(
    heads: int, kv_heads: int, dim: int, block_size: int, window: int | None
) -> None:
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


def test_a_rows_bits_do_not_depend_on_the_others() -> None:
    """Alone, among other rows of other lengths, in another order, at another row of the
    batch and on one thread: the same bits."""
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
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one_thread = attend(list(range(len(lengths))))
    finally:
        torch.set_num_threads(threads)
    for row in range(len(lengths)):
        alone = attend([row])
        assert torch.equal(alone[row], together[row]) and torch.equal(alone[row], backwards[row])
        assert torch.equal(alone[row], one_thread[row])
    # Row 0's query and sequence moved to the batch's last row, the others' tables widened.
    moved = torch.cat([query[1:], query[:1]])
    wide = torch.nn.functional.pad(tables, (0, 5))
    out = torch.zeros_like(query)
    order = [*range(1, len(lengths)), 0]
    generated = GeneratedRows.build(list(range(len(lengths))), wide[order], [positions[r] for r in order], None)
    attend_generated(moved, out, k_cache, v_cache, generated, 16, 0.125)
    assert torch.equal(out[-1], together[0])


def test_a_strided_output_gets_the_same_values() -> None:
    k_cache, v_cache, tables, _, _ = _cache_with_sequences([20, 40], 2, 16, 4, seed=6)
    query = torch.randn(3, 4, 16, generator=_gen(7))
    generated = GeneratedRows.build([0, 2], tables, [19, 39], None)
    plain = torch.zeros_like(query)
    attend_generated(query, plain, k_cache, v_cache, generated, 4, 0.25)
    strided = torch.zeros(4, 3, 16).transpose(0, 1)
    attend_generated(query, strided, k_cache, v_cache, generated, 4, 0.25)
    assert torch.equal(strided, plain)


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
) -> tuple[TorchSDPAMetadata, torch.Tensor]:
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


def test_backend_routes_rows_by_token_kind_and_a_recompute_keeps_the_decode_bits() -> None:
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


def test_a_mixed_step_gives_each_row_what_it_gets_alone() -> None:
    """Generated decodes, a prompt's one-token chunk and a recomputed request's chunk (prompt
    rows, then generated ones) in one step: each row's output is the one its sequence's own
    step gives it, and the rows land where they belong."""
    gen = _gen(8)
    # (block table, prompt length, context, new positions) per sequence
    sequences = [
        (torch.tensor([5, 2, 7], dtype=torch.int32), 4, 9, range(9, 10)),  # a generated decode
        (torch.tensor([1, 0, 0], dtype=torch.int32), 6, 5, range(5, 6)),  # the prompt's last token
        (torch.tensor([3, 6, 4], dtype=torch.int32), 5, 2, range(2, 10)),  # recomputed: 3 prompt, 5 generated
    ]
    qkv = [tuple(torch.randn(10, n, 16, generator=gen) for n in (4, 2, 2)) for _ in sequences]

    def cache_with_contexts() -> torch.Tensor:
        cache = torch.zeros(2, 8, BLOCK, 2, 16)
        backend = _backend()
        for (table, prompt_len, context, _), seq_qkv in zip(sequences, qkv):
            if context:
                _step(backend, cache, table, 0, seq_qkv, range(context), min(prompt_len, context))
        return cache

    alone = []
    for (table, prompt_len, context, positions), seq_qkv in zip(sequences, qkv):
        _, out = _step(_backend(), cache_with_contexts(), table, context, seq_qkv, positions, prompt_len)
        alone.append(out)

    cache = cache_with_contexts()
    q: list[torch.Tensor] = []
    k: list[torch.Tensor] = []
    v: list[torch.Tensor] = []
    slots = []
    for (table, _, _, positions), seq_qkv in zip(sequences, qkv):
        idx = torch.tensor(list(positions))
        for part, rows in zip(seq_qkv, (q, k, v)):
            rows.append(part[idx])
        slots.append(table[idx // BLOCK].long() * BLOCK + idx % BLOCK)
    batch = StepBatch(
        query_starts=[0, 1, 2],
        query_lens=[len(p) for *_, p in sequences],
        context_lens=[c for _, _, c, _ in sequences],
        block_tables=torch.stack([t for t, *_ in sequences]),
        num_decodes=2,
        slot_mapping=torch.cat(slots),
        prompt_lens=[p for _, p, _, _ in sequences],
    )
    backend = _backend()
    metadata = backend.build_metadata(batch)
    assert metadata.generated is not None and metadata.generated.rows.tolist() == [0, 5, 6, 7, 8, 9]
    assert [(g.start, g.end) for g in metadata.decode_groups] == [(1, 2)]
    assert [(c.query_start, c.query_len) for c in metadata.prefills] == [(2, 3)]
    out = backend.forward(torch.cat(q), torch.cat(k), torch.cat(v), cache, metadata)
    assert torch.equal(out[0:1], alone[0]) and torch.equal(out[1:2], alone[1]) and torch.equal(out[2:], alone[2])


def test_the_kernel_serves_only_float32_attention_over_a_plain_cache(
    monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Callable[[str], str]
) -> None:
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
    monkeypatch.setattr(paged_decode._kernel, "function", lambda: None)
    assert not TorchSDPABackend(SPEC, BLOCK).use_paged_decode(cpu, torch.float32)


def test_starting_the_kernel_keeps_torchs_thread_count() -> None:
    """numba's OpenMP threads set the OpenMP thread count as they start; torch's is put back."""
    code = (
        "import torch\n"
        "from cadence.kernels.cpu import paged_decode\n"
        "before = torch.get_num_threads()\n"
        "assert paged_decode.available()\n"
        "print(before, torch.get_num_threads())"
    )
    assert run_python(code, OMP_NUM_THREADS="1") == "1 1"


@pytest.mark.parametrize("dim,window", [(64, None), (80, 37), (128, None)])
def test_a_process_forked_after_the_kernel_ran_runs_it_serially(dim: int, window: int | None) -> None:
    """GNU OpenMP's threads do not survive a fork: the child runs the serial form. It is
    compiled apart from the parallel form, and LLVM may vectorize its sums otherwise, so
    the child's bits may differ from the parent's; within the child a row still has the
    bits it has alone, and the values are right."""
    code = (
        "import os, torch\n"
        "from cadence.kernels.cpu import paged_decode\n"
        "from cadence.kernels.cpu.paged_decode import GeneratedRows, attend_generated\n"
        "gen = torch.Generator().manual_seed(0)\n"
        f"cache = [torch.randn(64 * 16, 3, {dim}, generator=gen) for _ in range(2)]\n"
        f"query = torch.randn(8, 9, {dim}, generator=gen)\n"
        "tables = torch.randperm(64, generator=gen).to(torch.int32).view(8, 8)\n"
        "positions = [13 * i + 30 for i in range(8)]\n"
        "def run(rows):\n"
        "    out = torch.zeros_like(query)\n"
        f"    generated = GeneratedRows.build(rows, tables[rows], [positions[r] for r in rows], {window})\n"
        f"    attend_generated(query, out, *cache, generated, 16, {dim} ** -0.5)\n"
        "    return out.numpy()[rows]\n"
        "parent = run(list(range(8)))\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    # numpy only: torch's own parallel ops would hang in a forked child.\n"
        "    child = run(list(range(8)))\n"
        "    alone = all((run([r])[0] == child[r]).all() for r in range(8))\n"
        "    close = abs(child - parent).max() < 1e-5\n"
        "    os._exit(0 if paged_decode.available() and alone and close else 3)\n"
        "print(os.waitpid(pid, 0)[1] >> 8)"
    )
    assert run_python(code) == "0"
