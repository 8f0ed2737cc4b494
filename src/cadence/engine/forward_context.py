"""The one carrier of a forward pass's per-step state to the model's layers.

The runner builds one ``ForwardContext`` per step (``for_step``), and the CUDA-graph
capture one per captured graph over its static buffers; it is passed to the model's
``forward`` explicitly and down to every layer that needs it. Nothing else carries
per-step state to layers: no module globals, no context variables, no attributes set on
modules between steps. So a later per-step concern (each token's LoRA slot, a grammar's
bitmask) is a field here, not a new path through the model.

What it holds today is what attention reads: the backend, every layer's KV cache, and the
metadata the backend built once from the step's ``StepBatch``. The split of a step's
rows into prompt tokens' and generated tokens' (for a backend that
``splits_generated_rows``) is part of that metadata, built from ``StepBatch.prompt_lens``.
"""

from __future__ import annotations

from typing import Any

import torch

from cadence.engine.attention.backend import AttentionBackend, KVCache, StepBatch


class ForwardContext:
    """One forward pass's state for the model's layers: attention's backend, caches and
    step metadata. Built once per step, read by every layer, never changed by them."""

    def __init__(self, backend: AttentionBackend, kv_caches: list[KVCache], attention_metadata: Any) -> None:
        self.backend = backend
        self.kv_caches = kv_caches
        self.attention_metadata = attention_metadata

    @classmethod
    def for_step(cls, backend: AttentionBackend, kv_caches: list[KVCache], batch: StepBatch) -> ForwardContext:
        """The context of an eager step: the backend's metadata for ``batch``, built once
        here for all layers."""
        return cls(backend, kv_caches, backend.build_metadata(batch))

    def attend(self, layer_idx: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """Layer ``layer_idx``'s paged attention: its new K/V written to the cache, then attended."""
        return self.backend.forward(query, key, value, self.kv_caches[layer_idx], self.attention_metadata)
