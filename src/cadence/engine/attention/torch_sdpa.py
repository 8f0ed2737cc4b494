"""Paged attention in plain torch: scatter new K/V into slots, gather blocks, run SDPA.

It serves the CPU, and any device until a faster kernel backend is chosen. Decodes are
answered a group at a time with one padded SDPA call (a validity mask hides the padding),
so the number of attention calls per layer does not grow with the batch size (on CPU, a
big group takes one call per few MiB of gathered K/V, at the group's shape). Grouping
decodes of similar length keeps the padded gather, the dominant cost of CPU decode, near
the real context size when lengths are mixed. On CPU, once the runner calls
``use_paged_decode``, generated tokens' rows skip all of this for ``paged_decode``,
and only prompt tokens' rows come here (a prompt's one-token chunk as a decode call of
its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cadence.engine.attention.backend import AttentionBackend, AttentionSpec, KVCache, StepBatch, split_kv_cache
from cadence.kernels.batch_invariant.sdpa import (
    PREFILL_SEGMENT,
    InvariantShape,
    decode_attention,
    decode_mask,
    invariant_shape,
    prefill_attention,
    prefill_mask,
)
from cadence.kernels.cpu import paged_decode
from cadence.kernels.cpu.paged_decode import GeneratedRows
from cadence.kernels.formats.kv_quant import dequantize_rows, quantize_rows


@dataclass
class BlockGather:
    """The CPU's read of a padded context: whole cache blocks (``[..., blocks]`` ids, block 0
    past a sequence's last block) cut to ``length`` positions. Copying blocks rather than
    slots moves the same bytes in far fewer, larger pieces; the positions past a
    sequence's end hold whatever finite K/V their block holds, read under a -inf mask."""

    block_ids: torch.Tensor
    length: int


@dataclass
class PrefillChunk:
    """One multi-token chunk (on CPU, a segment of one): its rows in the flat batch and what
    it attends to."""

    query_start: int
    query_len: int
    # None on CUDA when the chunk starts the sequence: it then attends to its own new K/V
    # only; and on CPU, which reads blocks (``gather_blocks``).
    gather_slots: torch.Tensor | None
    # CUDA: [query_len, kv_len] bool, True = attend, or None = causal. CPU: always a float
    # mask, its rows and keys padded as kernels/batch_invariant/sdpa.py's prefill_mask makes them.
    attn_mask: torch.Tensor | None
    gather_blocks: BlockGather | None = None


@dataclass
class DecodeGroup:
    """Decode rows [start, end) of the flat batch, padded to the longest of them (on CPU,
    further to ``InvariantShape.kv_len``)."""

    start: int
    end: int
    gather_slots: torch.Tensor | None  # [rows, max_len] slots, padded (CUDA; CPU reads blocks)
    # [rows, 1, 1, max_len]: bool, True = attend, on CUDA (where a mask also keeps SDPA
    # off the flash kernel); the additive float mask of kernels/batch_invariant/sdpa.py's decode_mask on CPU.
    attn_mask: torch.Tensor
    gather_blocks: BlockGather | None = None


@dataclass
class TorchSDPAMetadata:
    slot_mapping: torch.Tensor
    decode_groups: list[DecodeGroup]
    prefills: list[PrefillChunk]
    # CPU, with the paged decode kernel: the rows of generated tokens, which it answers
    # (decode groups and prefill chunks then hold prompt tokens' rows only).
    generated: GeneratedRows | None = None


# The gathered K/V one decode call reads: a group is attended a part of its rows at a
# time, so each part's copy is still in the CPU's cache when SDPA reads it back, rather
# than written out to memory whole and read in again.
_DECODE_PART_BYTES = 4 << 20

# A decode group ends where a row's context is this many times the group's first one.
# Rows arrive sorted by length, so padding waste stays under half of each group.
_DECODE_GROUP_SPREAD = 2


def group_by_length(lengths: list[int]) -> list[tuple[int, int]]:
    """Contiguous [start, end) runs whose lengths stay within the spread of their first."""
    groups: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or lengths[i] > _DECODE_GROUP_SPREAD * lengths[start]:
            groups.append((start, i))
            start = i
    return groups


def leading_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """int64 cache slots of positions 0..length-1 through a padded block table row or rows
    (int32 `[..., blocks]`): each needed block's slots at once, rather than a divide,
    gather and remainder per position, which cost several passes over the whole padded
    context on every decode step. Contiguous, since every layer gathers with it."""
    num_blocks = -(-length // block_size)
    offsets = torch.arange(block_size, device=block_table.device)
    slots = block_table[..., :num_blocks, None].long() * block_size + offsets
    return slots.flatten(-2)[..., :length].contiguous()


# cuDNN attention builds an execution plan for every new shape; with decode lengths that
# change every step that host time outweighed the GPU work many times (bench/RESULTS.md).
# CPU has no cuDNN, so CPU calls skip the `sdpa_kernel` context, which costs per entry.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots] for a [slots, ...] cache; index_select copies rows about twice as fast
    as advanced indexing on CPU, and this copy is the main cost of decode."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


@dataclass
class _SlotRows:
    """One of K or V of a layer's cache viewed as rows [slots, heads, dim], quantized or not."""

    rows: torch.Tensor
    scales: torch.Tensor | None  # [slots, heads] for a quantized cache
    dtype: torch.dtype  # what reads return

    def write(self, slots: torch.Tensor, x: torch.Tensor) -> None:
        if self.scales is None:
            _copy_rows(self.rows, slots, x)
            return
        stored, scale = quantize_rows(x, self.rows.dtype)
        _copy_rows(_bytes(self.rows), slots, _bytes(stored))
        self.scales.index_copy_(0, slots, scale)

    def gather(self, slots: torch.Tensor) -> torch.Tensor:
        if self.scales is None:
            return _gather(self.rows, slots)
        stored = _gather(_bytes(self.rows), slots).view(self.rows.dtype)
        return dequantize_rows(stored, _gather(self.scales, slots), self.dtype)

    def gather_blocks(self, blocks: BlockGather, block_size: int) -> torch.Tensor:
        """``[..., blocks.length, heads, dim]``: the blocks' rows, in order, cut to length."""
        if self.scales is None:
            return _gather_blocks(self.rows, blocks, block_size)
        stored = _gather_blocks(_bytes(self.rows), blocks, block_size).view(self.rows.dtype)
        return dequantize_rows(stored, _gather_blocks(self.scales, blocks, block_size), self.dtype)


def _gather_blocks(rows: torch.Tensor, blocks: BlockGather, block_size: int) -> torch.Tensor:
    # 2-D, one row per block: index_select copies each row whole (a 4-D view took as
    # long as copying slot by slot).
    per_block = rows.view(rows.shape[0] // block_size, -1)
    got = per_block.index_select(0, blocks.block_ids.reshape(-1))
    positions = got.view(*blocks.block_ids.shape[:-1], -1, *rows.shape[1:])
    return positions.narrow(-rows.dim(), 0, blocks.length)


def _copy_rows(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor) -> None:
    """``cache[slots] = x`` for ``[slots, heads, dim]`` rows, through 2-D views: CPU
    index_copy_ over the 3-D shapes walks element by element and took tens of times longer
    for a prompt's rows."""
    rows = cache.view(cache.shape[0], -1)
    rows.index_copy_(0, slots, x.reshape(-1, rows.shape[1]))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    """A 1-byte cache as uint8: CPU index_copy_/index_select have no fp8 kernels, and
    moving bytes is all they do here."""
    return x.view(torch.uint8)


class TorchSDPABackend(AttentionBackend):
    """The reference paged attention: exact, portable, and fast enough on CPU, where every
    row's output is also batch-invariant (``kernels/batch_invariant/sdpa.py``). ``dtype`` is the model's:
    the query padding that keeps rows invariant is measured for it."""

    def __init__(self, spec: AttentionSpec, block_size: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__(spec, block_size)
        self.dtype = dtype
        self._invariant: InvariantShape | None = None
        self._generated_kernel = False

    def use_paged_decode(self, device: torch.device, cache_dtype: torch.dtype | None) -> bool:
        """Answer generated tokens' rows with ``paged_decode`` from now on, where it
        serves: on CPU, float32 attention over a float32 cache (``cache_dtype`` None: a
        quantized one), with numba there. Whether it does."""
        plain = self.dtype == torch.float32 and cache_dtype == torch.float32
        self._generated_kernel = device.type == "cpu" and plain and paged_decode.available()
        return self._generated_kernel

    @property
    def splits_generated_rows(self) -> bool:
        return self._generated_kernel

    @property
    def invariant(self) -> InvariantShape:
        """The CPU calls' query and key padding, measured on first use: the engine's warm-up
        on CPU (never on CUDA)."""
        if self._invariant is None:
            self._invariant = invariant_shape(self.spec, self.dtype)
        return self._invariant

    def build_metadata(self, batch: StepBatch) -> TorchSDPAMetadata:
        if batch.slot_mapping.device.type == "cpu":
            return self._invariant_metadata(batch)
        device = batch.slot_mapping.device
        window = self.spec.sliding_window
        num_decodes = batch.num_decodes
        tables = batch.block_tables

        decode_lens = [n + 1 for n in batch.context_lens[:num_decodes]]
        decode_groups = []
        for start, end in group_by_length(decode_lens):
            lens = decode_lens[start:end]
            max_len = max(lens)
            slots = leading_slots(tables[start:end], max_len, self.block_size)
            positions = torch.arange(max_len, device=device).expand(end - start, max_len)
            seq_lens = torch.tensor(lens, device=device)[:, None]
            mask = positions < seq_lens
            if window is not None:
                mask &= positions >= seq_lens - window
            decode_groups.append(DecodeGroup(start, end, slots, mask[:, None, None, :]))

        prefills = []
        for i in range(num_decodes, batch.num_seqs):
            context_len, query_len = batch.context_lens[i], batch.query_lens[i]
            kv_len = context_len + query_len
            chunk_slots: torch.Tensor | None = None
            chunk_mask: torch.Tensor | None = None
            if context_len:
                chunk_slots = leading_slots(tables[i], kv_len, self.block_size)
            if context_len or window is not None:
                query_pos = torch.arange(context_len, kv_len, device=device)[:, None]
                key_pos = torch.arange(kv_len, device=device)[None, :]
                chunk_mask = key_pos <= query_pos
                if window is not None:
                    chunk_mask &= key_pos > query_pos - window
            prefills.append(PrefillChunk(batch.query_starts[i], query_len, chunk_slots, chunk_mask))
        return TorchSDPAMetadata(batch.slot_mapping, decode_groups, prefills)

    def _invariant_metadata(self, batch: StepBatch) -> TorchSDPAMetadata:
        """The CPU's batch-invariant calls (``kernels/batch_invariant/sdpa.py``): key lengths padded by
        ``InvariantShape.kv_len`` and read in whole blocks (``BlockGather``), float masks
        always, and each prefill chunk cut into segments that see keys up to their own end."""
        device = batch.slot_mapping.device
        window = self.spec.sliding_window
        num_decodes = batch.num_decodes
        tables = batch.block_tables
        decode_lens = [n + 1 for n in batch.context_lens[:num_decodes]]
        decode_groups = []
        shape = self.invariant
        # With the paged kernel, generated tokens' rows go to it, and only prompt tokens'
        # stay here: the first `prompt_lens[i]` positions of sequence i.
        generated = _GeneratedRowsBuilder(tables, window)
        prompt_lens = self._prompt_lens(batch)
        if prompt_lens is None:
            runs = group_by_length([shape.kv_len(n) for n in decode_lens])
        else:  # a prompt's one-token chunk is a decode call of its own
            runs = []
            for i, length in enumerate(decode_lens):
                if length <= prompt_lens[i]:
                    runs.append((i, i + 1))
                else:
                    generated.add(batch.query_starts[i], i, length - 1)
        for start, end in runs:
            lens = decode_lens[start:end]
            mask = decode_mask(lens, shape, window, self.dtype, device)
            blocks = self._padded_blocks(tables[start:end], lens, mask.shape[-1])
            # A big group is attended in parts, each at the group's padded key length: the
            # same call shape, so every row gets the bits one call over the group gives it.
            step = self._decode_part_rows(mask.shape[-1])
            for first in range(0, end - start, step):
                part = slice(first, min(first + step, end - start))
                part_blocks = BlockGather(blocks.block_ids[part], blocks.length)
                decode_groups.append(DecodeGroup(start + part.start, start + part.stop, None, mask[part], part_blocks))
        prefills = []
        for i in range(num_decodes, batch.num_seqs):
            context_len, query_len = batch.context_lens[i], batch.query_lens[i]
            prompt_rows = query_len if prompt_lens is None else min(max(prompt_lens[i] - context_len, 0), query_len)
            for row in range(prompt_rows, query_len):  # a recomputed request's generated tokens
                generated.add(batch.query_starts[i] + row, i, context_len + row)
            for offset in range(0, prompt_rows, PREFILL_SEGMENT):
                start, end = context_len + offset, context_len + min(offset + PREFILL_SEGMENT, prompt_rows)
                mask = prefill_mask(start, end, shape, window, self.dtype, device)
                blocks = self._padded_blocks(tables[i], [end], mask.shape[-1])
                prefills.append(PrefillChunk(batch.query_starts[i] + offset, end - start, None, mask, blocks))
        return TorchSDPAMetadata(batch.slot_mapping, decode_groups, prefills, generated.build())

    def _prompt_lens(self, batch: StepBatch) -> list[int] | None:
        """How many leading positions of each sequence are prompt tokens' rows, answered by
        SDPA; None where SDPA answers every row (without the paged kernel, or where numba
        cannot build it)."""
        if not (self._generated_kernel and paged_decode.available()):
            return None
        if batch.prompt_lens is None:
            raise ValueError("a step for the CPU paged decode kernel must state its prompt_lens")
        return list(batch.prompt_lens)

    def _decode_part_rows(self, kv_len: int) -> int:
        """Rows per decode call at a padded key length: about ``_DECODE_PART_BYTES`` of
        gathered K/V (as the gather returns it, in the attention's dtype), but never so few
        that the flash kernel's (row, KV head) work items leave threads idle."""
        kv_heads = self.spec.num_kv_heads
        row_bytes = 2 * kv_len * kv_heads * self.spec.head_dim * self.dtype.itemsize
        return max(_DECODE_PART_BYTES // row_bytes, -(-torch.get_num_threads() // kv_heads), 1)

    def _padded_blocks(self, tables: torch.Tensor, lengths: list[int], padded: int) -> BlockGather:
        """The blocks holding each row's ``lengths`` positions (``tables`` ``[rows, blocks]``,
        or one row ``[blocks]`` with one length), then block 0 up to ``padded`` positions:
        cache rows that are always finite (the cache starts zeroed, and only model K/V is
        written to it), read under a -inf mask."""
        size = self.block_size
        num_blocks = -(-padded // size)
        width = min(num_blocks, tables.shape[-1])
        used = torch.tensor([-(-n // size) for n in lengths], device=tables.device).view(*tables.shape[:-1], 1)
        ids = tables[..., :width].long()
        ids = torch.where(torch.arange(width, device=tables.device) < used, ids, 0)
        return BlockGather(F.pad(ids, (0, num_blocks - width)), padded)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: TorchSDPAMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        slots = metadata.slot_mapping
        values, scales = split_kv_cache(kv_cache)
        caches = [
            _SlotRows(
                values[i].view(-1, num_kv_heads, head_dim),
                None if scales is None else scales[i].view(-1, num_kv_heads),
                query.dtype,
            )
            for i in (0, 1)
        ]
        caches[0].write(slots, key)
        caches[1].write(slots, value)
        if not query.is_cuda:
            return self._attend(query, key, value, caches[0], caches[1], metadata)
        with sdpa_kernel(_SDPA_BACKENDS):
            return self._attend(query, key, value, caches[0], caches[1], metadata)

    def _attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: _SlotRows,
        value_cache: _SlotRows,
        metadata: TorchSDPAMetadata,
    ) -> torch.Tensor:
        out = torch.empty_like(query)
        if not query.is_cuda:
            self._attend_invariant(query, out, key_cache, value_cache, metadata)
            return out
        scale = self.spec.scale
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        for group in metadata.decode_groups:
            assert group.gather_slots is not None
            keys = key_cache.gather(group.gather_slots).transpose(1, 2)  # [rows, kv_heads, max_len, head_dim]
            values = value_cache.gather(group.gather_slots).transpose(1, 2)
            rows = group.end - group.start
            # A decode token's query heads that share a KV head go in as that head's query
            # rows ([rows, kv_heads, heads per kv head, D]), not through enable_gqa: each
            # row attends to the same keys under the same mask, and the CPU flash kernel
            # then reads each K/V block once per KV head rather than once per query head
            # (`git show 90ba143:bench/HISTORY.md` has the comparison). Query head h maps to KV head
            # h // group size, as enable_gqa (and transformers' repeat_kv) map it.
            decoded = F.scaled_dot_product_attention(
                query[group.start : group.end].view(rows, num_kv_heads, -1, head_dim),
                keys,
                values,
                attn_mask=group.attn_mask,
                scale=scale,
            )
            # Copied through a view of out: CUDA's kernels may return the folded layout
            # with its head and row dims swapped in memory, which decoded.view would refuse.
            out[group.start : group.end].view(rows, num_kv_heads, -1, head_dim).copy_(decoded)
        for chunk in metadata.prefills:
            chunk_rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.gather_slots is None and key_cache.scales is None:
                keys, values = key[chunk_rows], value[chunk_rows]
            elif chunk.gather_slots is None:
                # A quantized cache: attend to the K/V as stored, as decodes and the
                # Triton backend do, so a prompt reads the same whether fresh or cached.
                slots = metadata.slot_mapping[chunk_rows]
                keys, values = key_cache.gather(slots), value_cache.gather(slots)
            else:
                keys, values = key_cache.gather(chunk.gather_slots), value_cache.gather(chunk.gather_slots)
            # A batch dimension of 1 matters: 3-D inputs miss the CPU flash kernel.
            attended = F.scaled_dot_product_attention(
                query[chunk_rows].transpose(0, 1).unsqueeze(0),
                keys.transpose(0, 1).unsqueeze(0),
                values.transpose(0, 1).unsqueeze(0),
                attn_mask=chunk.attn_mask,
                is_causal=chunk.attn_mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[chunk_rows] = attended[0].transpose(0, 1)
        return out

    def _attend_invariant(
        self,
        query: torch.Tensor,
        out: torch.Tensor,
        key_cache: _SlotRows,
        value_cache: _SlotRows,
        metadata: TorchSDPAMetadata,
    ) -> None:
        """The CPU path: every call shaped by ``kernels/batch_invariant/sdpa.py``, every K/V read from the
        cache as stored (so a prompt reads the same fresh, chunked or cached)."""
        num_kv_heads, head_dim = key_cache.rows.shape[1], key_cache.rows.shape[2]
        if metadata.generated is not None:
            paged_decode.attend_generated(
                query, out, key_cache.rows, value_cache.rows, metadata.generated, self.block_size, self.spec.scale
            )
        for group in metadata.decode_groups:
            rows = group.end - group.start
            assert group.gather_blocks is not None
            decoded = decode_attention(
                query[group.start : group.end].view(rows, num_kv_heads, -1, head_dim),
                key_cache.gather_blocks(group.gather_blocks, self.block_size).transpose(1, 2),
                value_cache.gather_blocks(group.gather_blocks, self.block_size).transpose(1, 2),
                group.attn_mask,
                self.spec.scale,
                self.invariant.decode_rows,
            )
            out[group.start : group.end].view(rows, num_kv_heads, -1, head_dim).copy_(decoded)
        for chunk in metadata.prefills:
            assert chunk.gather_blocks is not None and chunk.attn_mask is not None
            chunk_rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[chunk_rows] = prefill_attention(
                query[chunk_rows],
                key_cache.gather_blocks(chunk.gather_blocks, self.block_size),
                value_cache.gather_blocks(chunk.gather_blocks, self.block_size),
                chunk.attn_mask,
                self.spec.scale,
            )


class _GeneratedRowsBuilder:
    """Collects a step's generated tokens' rows for ``GeneratedRows``."""

    def __init__(self, tables: torch.Tensor, window: int | None) -> None:
        self.tables, self.window = tables, window
        self.rows: list[int] = []
        self.sequences: list[int] = []
        self.positions: list[int] = []

    def add(self, row: int, sequence: int, position: int) -> None:
        """Flat ``row`` holds the generated token at ``position`` of ``sequence``."""
        self.rows.append(row)
        self.sequences.append(sequence)
        self.positions.append(position)

    def build(self) -> GeneratedRows | None:
        if not self.rows:
            return None
        tables = self.tables.index_select(0, torch.tensor(self.sequences, device=self.tables.device))
        return GeneratedRows.build(self.rows, tables, self.positions, self.window)
