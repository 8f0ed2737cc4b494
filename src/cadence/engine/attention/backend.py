"""The one interface every attention implementation sits behind.

A step's batch is flattened: T new tokens from many sequences, no padding. Sequences
that add exactly one token (decodes) come first, then the multi-token chunks (prefills).
Each backend turns the backend-neutral `StepBatch` into its own metadata once per step,
which the step's `ForwardContext` (engine/forward_context.py) hands to every layer. A
backend whose step needs no host sync can also describe a pure-decode step over static
buffers, which engine/cuda_graphs.py captures and replays (`graph_variants`,
`pick_graph_variant`, `graph_metadata`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepBatch:
    """Where each sequence's new tokens sit in the flat batch and in the paged cache.

    `query_lens[i]` new tokens of sequence i start at flat index `query_starts[i]`;
    `context_lens[i]` tokens of it are already in the cache; row i of `block_tables`
    holds its block ids, padded with 0. The first `num_decodes` sequences have query
    length 1. `prompt_lens[i]`, where the runner states it (a backend that
    `splits_generated_rows`), is sequence i's prompt length: its positions from there on
    hold generated tokens.
    """

    query_starts: list[int]
    query_lens: list[int]
    context_lens: list[int]
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    num_decodes: int
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) per new token
    prompt_lens: list[int] | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)


@dataclass
class QuantizedKVCache:
    """One layer's quantized cache: int8/fp8 `values` shaped like a plain cache, and a
    float32 scale per (slot, KV head) in `scales [2, num_blocks, block_size, num_kv_heads]`
    (the format of kernels/formats/kv_quant.py)."""

    values: torch.Tensor
    scales: torch.Tensor


# One layer's cache: a plain tensor in the model's dtype, or a quantized one.
KVCache = torch.Tensor | QuantizedKVCache


def split_kv_cache(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, scales) of a layer's cache; scales is None for a plain one."""
    if isinstance(cache, QuantizedKVCache):
        return cache.values, cache.scales
    return cache, None


@dataclass
class DecodeGraphInputs:
    """The static device buffers a captured decode forward reads: a padded batch of
    sequences that add one token each, rewritten before every replay."""

    slot_mapping: torch.Tensor  # [batch] int64; -1 in padding rows, whose write is skipped
    block_tables: torch.Tensor  # [batch, max_blocks] int32
    seq_lens: torch.Tensor  # [batch] int64: context + the new token
    query_start_loc: torch.Tensor  # [batch + 1] int32: sequence i's query is row i
    max_seq_len: int  # the longest sequence a replay may hold


@dataclass(frozen=True)
class AttentionSpec:
    """The shape of attention that a model asks of a backend."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float
    sliding_window: int | None = None  # attend to at most this many most recent positions


class AttentionBackend(ABC):
    """Computes paged attention for a flat varlen batch.

    The KV cache for one layer is a tensor [2, num_blocks, block_size, num_kv_heads,
    head_dim] (index 0 holds keys, 1 values), or a `QuantizedKVCache` of that shape plus
    its scales.
    """

    # Whether a decode step's forward may be captured in a CUDA graph: no host syncs, and
    # `graph_metadata` over static buffers (engine/cuda_graphs.py).
    supports_cuda_graphs = False

    def __init__(self, spec: AttentionSpec, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size

    def use_paged_decode(self, device: torch.device, cache_dtype: torch.dtype | None) -> bool:
        """Answer generated tokens' rows straight from the paged cache from now on, where
        the backend has such a kernel for this device and cache (``cache_dtype`` None: a
        quantized cache); whether it does. Opt-in: the runner asks, a backend built
        directly keeps its one path."""
        return False

    @property
    def splits_generated_rows(self) -> bool:
        """Whether rows of generated tokens attend through another kernel than prompt
        tokens' rows: the runner then states each step's `prompt_lens`, and the prefix
        cache keeps blocks of generated tokens apart from prompts' (as for the CPU linears)."""
        return False

    @abstractmethod
    def build_metadata(self, batch: StepBatch) -> Any:
        """Precompute, once per step, whatever every layer's `forward` needs."""

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: KVCache,
        metadata: Any,
    ) -> torch.Tensor:
        """Write the new K/V into their slots, then attend; returns [T, num_heads, head_dim]."""

    # ----- CUDA-graph hooks (with supports_cuda_graphs) ----------------------------------
    def graph_variants(self, batch_size: int, max_seq_len: int, device: torch.device) -> list[int]:
        """The variants of one padded batch size's decode forward to capture, ascending: a
        backend whose launches depend on more than the batch size names them (the Triton
        backend's split-KV counts). One by default."""
        return [1]

    def pick_graph_variant(
        self, batch_size: int, longest_seq_len: int, variants: list[int], device: torch.device
    ) -> int:
        """Which captured variant replays a step whose longest sequence (with its new token)
        is `longest_seq_len`; every variant must compute the same result."""
        return variants[0]

    def graph_metadata(self, inputs: DecodeGraphInputs, variant: int) -> Any:
        """Metadata for a decode forward that reads nothing but `inputs`' buffers, so that a
        captured graph stays valid as they are rewritten."""
        raise NotImplementedError(f"{type(self).__name__} has no CUDA-graph support")
