"""Dense linears on ``bf16dot``: the CPU's bf16 precision for unquantized checkpoints.

Under ``Precision.bf16_dot_linears`` (``engine/precision.py``) a dense checkpoint's linears
multiply bf16 weights by bf16-rounded activations with fp32 sums, in Cadence's own GEMM
(``kernels/cpu/bf16_dot.py``), which sums each row in one fixed order whatever the batch
size: batch-invariant by construction, with no tile sizes to measure and no padding of a
batch-1 call (what ``invariant_linear`` needs for BLAS). Activations stay float32.

Memory: ``stage_bf16`` gives the dense layers (and the layers quantized at load) bf16
weights before storage is allocated, so a bf16 checkpoint loads at its own size (not
doubled to fp32); ``hold_bf16_dot`` then packs each dense one and drops the unpacked
weight, so those weights are held once, in bf16. A dense head tied to the embedding is
packed as a second, bf16 copy beside the float32 embedding table, which lookups read.
"""

from __future__ import annotations

import torch
from torch import nn

from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.quantization.linear_layer import DenseMethod, LinearLayer
from cadence.engine.quantization.lm_head import Int8HeadMethod
from cadence.kernels.cpu import bf16_dot


def _dense_layers(model: CausalLM) -> list[LinearLayer]:
    """The layers whose weight is their own and dense (not a quantized method's staging
    weight, nor an offloaded expert slot's, which another expert's weights replace)."""
    return [
        m for m in model.modules() if isinstance(m, LinearLayer) and type(m.method) is DenseMethod and m.weights_fixed
    ]


def stage_bf16(model: CausalLM) -> None:
    """Before storage is allocated (``to_empty``): the weights that dense layers and
    load-time quantizing methods stage, in bf16, so the checkpoint is cast to bf16 as it
    streams in (a quantized model's peak stays the bf16 model, not an fp32 one). The int8
    head's staging keeps the activations' dtype: its embedding lookups return it."""
    for layer in model.modules():
        staged = isinstance(layer, LinearLayer) and isinstance(layer.method, DenseMethod) and layer.weights_fixed
        if staged and hasattr(layer, "weight") and not isinstance(layer.method, Int8HeadMethod):
            layer.weight.data = layer.weight.data.to(torch.bfloat16)


def hold_bf16_dot(model: CausalLM) -> None:
    """Pack every dense layer's weight for ``bf16dot`` and drop the unpacked one; pack a
    dense head tied to the embedding too (``cpu_head_dot``)."""
    for layer in _dense_layers(model):
        layer.cpu_dot = bf16_dot.pack(layer.weight.detach())
        del layer.weight
    if isinstance(model, LlamaForCausalLM) and model.lm_head is None:  # a dense tied head: the embedding
        embedding = model.model.embed_tokens
        assert isinstance(embedding, nn.Embedding)
        model.cpu_head_dot = bf16_dot.pack(embedding.weight.detach())
