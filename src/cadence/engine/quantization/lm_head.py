"""An int8 LM head, and an int8 embedding table that shares it when the two are tied.

The head is the largest single matrix a decode step reads (a fifth of SmolLM2, and
vocabulary x hidden in any model). ``--quantization`` leaves it dense, because its error
lands directly in the logits; ``--quantize-lm-head`` (``EngineArgs.quantize_lm_head``)
stores it as int8 with a scale per vocabulary row instead (``Int8HeadMethod``), the
precision llama.cpp's Q8_0 files keep it in, which moves perplexity by well under 1%
(bench/RESULTS.md). Any model can take it, quantized body or not.

When the embedding is tied to the head, the lookup reads the same int8 rows
(``Int8Embedding``), so the dense table is dropped rather than kept beside the quantized head.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cadence.engine.quantization.linear import Int8Method
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.kernels.cpu.chunked_linear import chunked_half_matmul
from cadence.kernels.cpu.half_linear import FORMATS, pack
from cadence.kernels.cpu.kernel_names import BF16DOT, DENSE, DEQUANT, FP16
from cadence.kernels.formats.quant_formats import quantize_int8

# Vocabulary rows quantized at a time: the fp32 temporaries of a whole 128k-row head
# would be gigabytes on the GPU, and the caching allocator would keep them from the KV cache.
ROWS_PER_CHUNK = 4096


class Int8HeadMethod(Int8Method):
    """The LM head as int8 per vocabulary row, float32 scales, quantized in row chunks.

    ``exact_weight`` gives the head's full-precision ``[vocab, hidden]`` value when the
    loaded one is rounded (a GGUF's blocks read into a bf16 model); otherwise the loaded
    weight (the head's, or the tied embedding's) is quantized.
    """

    def __init__(self, exact_weight: Callable[[], torch.Tensor] | None = None) -> None:
        self.exact_weight = exact_weight

    def cpu_kernels(self, layer: LinearLayer) -> tuple[str, ...]:
        # Not the packed op nor bf16: both return logits in bf16, whose 8-bit mantissa ties
        # the top candidates of a greedy argmax often enough to change answers. bf16dot
        # returns fp32 logits from the hidden state rounded to bf16, as every other linear
        # of the bf16 precision takes its input, and the int8 codes exactly (below).
        return (DEQUANT, DENSE, FP16, BF16DOT)

    def hold_half(self, layer: LinearLayer, kernel: str) -> None:
        if kernel != BF16DOT:
            super().hold_half(layer, kernel)
            return
        # The int8 codes are exact in bf16; the row scales multiply the fp32 products
        # instead of rounding each weight's value to bf16.
        layer.cpu_half[kernel] = {(0, layer.out_features): pack(FORMATS[BF16DOT], layer.qweight.float())}

    def run_cpu_kernel(self, layer: LinearLayer, x2: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel != BF16DOT:
            return super().run_cpu_kernel(layer, x2, kernel)
        if kernel not in layer.cpu_half:
            self.hold_half(layer, kernel)
        logits = chunked_half_matmul(x2, layer.out_features, layer.cpu_half[kernel])  # fp32
        logits *= layer.scale.float()
        return logits if x2.dtype == torch.float32 else logits.to(x2.dtype)

    def quantize(self, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        source = dense if self.exact_weight is None else self.exact_weight()
        if source.shape != dense.shape:
            raise ValueError(f"LM head weight {tuple(source.shape)} does not match the model's {tuple(dense.shape)}")
        return quantize_rows(source, dense.device)


class Int8Embedding(nn.Module):
    """Token embeddings read from an int8 head's rows: ``qweight[ids] * scale[ids]``."""

    def __init__(self, table: LinearLayer) -> None:
        super().__init__()
        self.table = table  # the head itself: one set of int8 buffers
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # As dequantize_int8 computes it (fp32 product, one rounding), for ids of any shape,
        # in the dtype the dense table was loaded in (the model's).
        rows = self.table.qweight[input_ids].float() * self.table.scale[input_ids].float().unsqueeze(-1)
        return rows.to(self.table.dense_dtype)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, int8 rows shared with the head"


def quantize_rows(weight: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_int8`` of ``weight`` onto ``device`` with float32 scales, a chunk of rows at
    a time (each row has its own scale, so chunking changes nothing)."""
    rows = weight.shape[0]
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=device)
    scale = torch.empty(rows, dtype=torch.float32, device=device)
    for start in range(0, rows, ROWS_PER_CHUNK):
        stop = min(start + ROWS_PER_CHUNK, rows)
        qweight[start:stop], scale[start:stop] = quantize_int8(weight[start:stop].to(device), torch.float32)
    return qweight, scale
