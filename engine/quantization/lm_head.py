"""An int8 LM head, and an int8 embedding table that shares it when the two are tied.

The head is the largest single matrix a decode step reads: 49,152 x 576 in SmolLM2 (a
fifth of the model), 128,256 x 4,096 in Llama-3-8B. ``--quantization`` leaves it dense,
because its error lands directly in the logits; ``--quantize-lm-head`` (``EngineArgs.
quantize_lm_head``) stores it as int8 with a scale per vocabulary row instead, which is
the precision llama.cpp's Q8_0 files keep it in and moves perplexity by well under 1%
(bench/RESULTS.md). Any model can take it, quantized body or not.

When the embedding is tied to the head, the lookup reads the same int8 rows, so the
dense table is dropped rather than kept beside the quantized head.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from cadence.engine.quantization.linear import Int8Linear
from cadence.kernels.quant_formats import quantize_int8

logger = logging.getLogger(__name__)

# Vocabulary rows quantized at a time: the fp32 temporaries of a whole 128k-row head
# would be gigabytes on the GPU, and the caching allocator would keep them from the KV cache.
ROWS_PER_CHUNK = 4096


class Int8Embedding(nn.Module):
    """Token embeddings read from an ``Int8Linear``'s rows: ``qweight[ids] * scale[ids]``."""

    def __init__(self, table: Int8Linear, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table  # the head itself when tied: one set of int8 buffers
        self.dtype = dtype  # what the dense nn.Embedding returned (the model's dtype)
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # As dequantize_int8 computes it (fp32 product, one rounding), for ids of any shape.
        rows = self.table.qweight[input_ids].float() * self.table.scale[input_ids].float().unsqueeze(-1)
        return rows.to(self.dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows shared with the head"


def install_int8_lm_head(model: nn.Module, exact_weight: torch.Tensor | None = None) -> None:
    """Swap the model's LM head (and a tied embedding) for int8 per vocabulary row.

    ``exact_weight`` is the head's full-precision ``[vocab, hidden]`` value when the
    loaded one was rounded (a GGUF's blocks read into a bf16 model); otherwise the loaded
    weight is quantized.
    """
    embedding: nn.Embedding = model.model.embed_tokens  # type: ignore[union-attr, assignment]
    tied = model.lm_head is None
    if not tied and not isinstance(model.lm_head, nn.Linear):
        # A GPTQ checkpoint with ``lm_head: true`` brings its own int4 head.
        raise ValueError(f"the LM head is already quantized ({type(model.lm_head).__name__}); "
                         "--quantize-lm-head applies to a dense head")
    dense = embedding.weight if tied else model.lm_head.weight  # type: ignore[union-attr]
    source = dense if exact_weight is None else exact_weight
    if source.shape != dense.shape:
        raise ValueError(f"LM head weight {tuple(source.shape)} does not match the model's {tuple(dense.shape)}")
    head = Int8Linear(*_quantize_rows(source.detach(), dense.device))
    before = dense.numel() * dense.element_size()
    model.lm_head = head
    if tied:
        model.model.embed_tokens = Int8Embedding(head, dense.dtype)  # type: ignore[union-attr]
    after = sum(b.numel() * b.element_size() for b in head.buffers())
    logger.info("LM head stored as int8 per row%s: %.1f MiB -> %.1f MiB",
                " (the tied embedding reads the same rows)" if tied else "", before / 2**20, after / 2**20)


def _quantize_rows(weight: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8`` of ``weight`` onto ``device``, a chunk of rows at a time (each row
    has its own scale, so chunking changes nothing)."""
    rows = weight.shape[0]
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=device)
    scale = torch.empty(rows, dtype=torch.float32, device=device)
    for start in range(0, rows, ROWS_PER_CHUNK):
        stop = min(start + ROWS_PER_CHUNK, rows)
        qweight[start:stop], scale[start:stop] = quantize_int8(weight[start:stop].to(device), torch.float32)
    return qweight, scale
