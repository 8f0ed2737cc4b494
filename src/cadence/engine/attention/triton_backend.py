"""Paged attention through Cadence's Triton kernels: the backend for CUDA.

Per layer it makes two launches: `write_kv_cache` puts the step's new K/V into their
slots, and `paged_attention` answers every query of the flat batch (decodes and prefill
chunks together) straight from the paged cache, with no gather copy. Per step, the
metadata is a handful of small int32 tensors built once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.engine.attention.backend import (
    AttentionBackend,
    AttentionSpec,
    DecodeGraphInputs,
    KVCache,
    StepBatch,
    split_kv_cache,
)
from cadence.kernels.triton.kv_cache_write import write_kv_cache
from cadence.kernels.triton.launch import num_sms
from cadence.kernels.triton.paged_attention import choose_num_splits, paged_attention


@dataclass
class TritonMetadata:
    """What every layer's kernels need for one step."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32 (int64 in a decode graph): context + new tokens
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    max_seq_len: int  # known on the host, so choosing split-KV never syncs the device
    # Split-KV pieces, fixed by a CUDA graph (its grid is baked in); None: chosen per step.
    num_splits: int | None = None


def split_ladder(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> list[int]:
    """Split-KV counts worth a graph for `num_seqs` decodes: powers of two up to what the
    longest possible context would choose."""
    top = choose_num_splits(num_seqs, num_kv_heads, max_seq_len, num_sms)
    ladder = [1]
    while ladder[-1] * 2 <= top:
        ladder.append(ladder[-1] * 2)
    return ladder


class TritonAttentionBackend(AttentionBackend):
    """Unified paged attention in Triton (on CPU tensors it needs TRITON_INTERPRET=1).

    The attention kernel's split-KV count is part of its grid, which a CUDA graph bakes
    in, so each padded decode batch size is captured once per count on `split_ladder`; a
    step replays the largest one not above what the kernel would choose for its real
    longest context (splits past a sequence's length do no work, so any count is
    correct, only the speed differs). With `batch_invariant` nothing splits: a split
    count chosen from the batch would change a sequence's sum over its KV range.
    """

    supports_cuda_graphs = True

    def __init__(self, spec: AttentionSpec, block_size: int, *, batch_invariant: bool = False) -> None:
        super().__init__(spec, block_size)
        # Every query row's bits independent of the batch (paged_attention's
        # batch_invariant): no split-KV, so one graph per batch size.
        self.batch_invariant = batch_invariant

    def build_metadata(self, batch: StepBatch) -> TritonMetadata:
        device = batch.block_tables.device
        seq_lens = [c + q for c, q in zip(batch.context_lens, batch.query_lens)]
        # The flat batch starts at row 0 and its sequences are contiguous.
        starts = list(batch.query_starts) + [sum(batch.query_lens)]
        return TritonMetadata(
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            max_query_len=max(batch.query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )

    def graph_variants(self, batch_size: int, max_seq_len: int, device: torch.device) -> list[int]:
        if self.batch_invariant:
            return [1]
        return split_ladder(batch_size, self.spec.num_kv_heads, max_seq_len, num_sms(device))

    def pick_graph_variant(
        self, batch_size: int, longest_seq_len: int, variants: list[int], device: torch.device
    ) -> int:
        if self.batch_invariant:
            return 1
        wanted = choose_num_splits(batch_size, self.spec.num_kv_heads, longest_seq_len, num_sms(device))
        return max(s for s in variants if s <= wanted)

    def graph_metadata(self, inputs: DecodeGraphInputs, variant: int) -> TritonMetadata:
        return TritonMetadata(
            slot_mapping=inputs.slot_mapping,
            block_tables=inputs.block_tables,
            seq_lens=inputs.seq_lens,
            query_start_loc=inputs.query_start_loc,
            max_query_len=1,
            max_seq_len=inputs.max_seq_len,
            num_splits=variant,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        metadata: TritonMetadata,
    ) -> torch.Tensor:
        values, scales = split_kv_cache(kv_cache)
        write_kv_cache(key, value, values, metadata.slot_mapping, scales)
        return paged_attention(
            query.contiguous(),
            values,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            metadata.max_query_len,
            self.spec.scale,
            window=self.spec.sliding_window,
            num_splits=metadata.num_splits,
            max_seq_len=metadata.max_seq_len,
            kv_scales=scales,
            batch_invariant=self.batch_invariant,
        )
