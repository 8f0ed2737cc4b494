"""Paged attention in plain torch: scatter new K/V into slots, gather blocks, run SDPA.

It serves the CPU, and any device until a faster kernel backend is chosen. All decodes of
a step share one padded SDPA call (a validity mask hides the padding), so the number of
attention calls per layer is 1 + the number of prefill chunks, not the batch size.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cadence.engine.attention.backend import AttentionBackend, StepBatch


@dataclass
class PrefillChunk:
    """One multi-token chunk: its rows in the flat batch and what it attends to."""

    query_start: int
    query_len: int
    # None when the chunk starts the sequence: it then attends to its own new K/V only.
    gather_slots: torch.Tensor | None
    attn_mask: torch.Tensor | None  # [query_len, kv_len] bool, True = attend; None = causal


@dataclass
class TorchSDPAMetadata:
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_gather_slots: torch.Tensor | None  # [D, max_len] slots, padded
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_len] bool
    prefills: list[PrefillChunk]


def gather_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of `positions` (any shape) in a padded block table row or rows."""
    block_index = torch.div(positions, block_size, rounding_mode="floor")
    return torch.gather(block_table, -1, block_index) * block_size + positions % block_size


class TorchSDPABackend(AttentionBackend):
    """The reference paged attention: exact, portable, and fast enough on CPU."""

    def build_metadata(self, batch: StepBatch) -> TorchSDPAMetadata:
        device = batch.slot_mapping.device
        window = self.spec.sliding_window
        num_decodes = batch.num_decodes
        width = max(len(t) for t in batch.block_tables)
        tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in batch.block_tables], dtype=torch.long, device=device
        )

        decode_slots = decode_mask = None
        if num_decodes:
            seq_lens = torch.tensor(batch.context_lens[:num_decodes], device=device) + 1
            max_len = int(seq_lens.max())
            positions = torch.arange(max_len, device=device).expand(num_decodes, max_len)
            decode_slots = gather_slots(tables[:num_decodes], positions, self.block_size)
            decode_mask = positions < seq_lens[:, None]
            if window is not None:
                decode_mask &= positions >= (seq_lens[:, None] - window)
            decode_mask = decode_mask[:, None, None, :]

        prefills = []
        for i in range(num_decodes, batch.num_seqs):
            context_len, query_len = batch.context_lens[i], batch.query_lens[i]
            kv_len = context_len + query_len
            slots = mask = None
            if context_len:
                positions = torch.arange(kv_len, device=device)
                slots = gather_slots(tables[i], positions, self.block_size)
            if context_len or window is not None:
                query_pos = torch.arange(context_len, kv_len, device=device)[:, None]
                key_pos = torch.arange(kv_len, device=device)[None, :]
                mask = key_pos <= query_pos
                if window is not None:
                    mask &= key_pos > query_pos - window
            prefills.append(PrefillChunk(batch.query_starts[i], query_len, slots, mask))
        return TorchSDPAMetadata(batch.slot_mapping, num_decodes, decode_slots, decode_mask, prefills)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: TorchSDPAMetadata,
    ) -> torch.Tensor:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        key_cache = kv_cache[0].view(-1, num_kv_heads, head_dim)
        value_cache = kv_cache[1].view(-1, num_kv_heads, head_dim)
        key_cache.index_copy_(0, metadata.slot_mapping, key)
        value_cache.index_copy_(0, metadata.slot_mapping, value)

        out = torch.empty_like(query)
        scale = self.spec.scale
        num_decodes = metadata.num_decodes
        if num_decodes:
            slots = metadata.decode_gather_slots
            keys = key_cache[slots].transpose(1, 2)  # [D, kv_heads, max_len, head_dim]
            values = value_cache[slots].transpose(1, 2)
            decoded = F.scaled_dot_product_attention(
                query[:num_decodes].unsqueeze(2),
                keys,
                values,
                attn_mask=metadata.decode_mask,
                scale=scale,
                enable_gqa=True,
            )
            out[:num_decodes] = decoded.squeeze(2)
        for chunk in metadata.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if chunk.gather_slots is None:
                keys, values = key[rows], value[rows]
            else:
                keys, values = key_cache[chunk.gather_slots], value_cache[chunk.gather_slots]
            attended = F.scaled_dot_product_attention(
                query[rows].transpose(0, 1),
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=chunk.attn_mask,
                is_causal=chunk.attn_mask is None,
                scale=scale,
                enable_gqa=True,
            )
            out[rows] = attended.transpose(0, 1)
        return out
