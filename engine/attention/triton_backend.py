"""Paged attention through Cadence's Triton kernels: the backend for CUDA.

Per layer it makes two launches: `write_kv_cache` puts the step's new K/V into their
slots, and `paged_attention` answers every query of the flat batch (decodes and prefill
chunks together) straight from the paged cache, with no gather copy. Per step, the
metadata is a handful of small int32 tensors built once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cadence.engine.attention.backend import AttentionBackend, KVCache, StepBatch, split_kv_cache
from cadence.kernels.kv_cache_write import write_kv_cache
from cadence.kernels.paged_attention import paged_attention


@dataclass
class TritonMetadata:
    """What every layer's kernels need for one step."""

    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: context + new tokens
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    max_seq_len: int  # known on the host, so choosing split-KV never syncs the device
    # Split-KV pieces, fixed by a CUDA graph (its grid is baked in); None: chosen per step.
    num_splits: int | None = None


class TritonAttentionBackend(AttentionBackend):
    """Unified paged attention in Triton (on CPU tensors it needs TRITON_INTERPRET=1)."""

    supports_cuda_graphs = True

    def build_metadata(self, batch: StepBatch) -> TritonMetadata:
        device = batch.block_tables.device
        seq_lens = [c + q for c, q in zip(batch.context_lens, batch.query_lens)]
        # The flat batch starts at row 0 and its sequences are contiguous.
        starts = list(batch.query_starts) + [sum(batch.query_lens)]
        return TritonMetadata(
            slot_mapping=batch.slot_mapping,
            block_tables=batch.block_tables.to(torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            max_query_len=max(batch.query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
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
        )
