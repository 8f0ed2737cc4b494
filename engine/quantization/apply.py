"""Swap a loaded dense model's projection layers for quantized ones (int8/int4 weight-only, fp8 W8A8)."""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from torch import nn

from cadence.engine.quantization.fp8_linear import Fp8Linear
from cadence.engine.quantization.linear import Int4Linear, Int8Linear

logger = logging.getLogger(__name__)

QUANTIZATION_METHODS = ("int8", "int4", "fp8", "gguf")
# The decoder's four GEMMs. Embeddings and lm_head stay dense: the head decides every
# sampled token (its error shows directly in the logits) and, when tied, *is* the embedding.
TARGET_LAYERS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
DEFAULT_GROUP_SIZE = 128
# Below this a group has too few weights for its scale to pay off, and the Triton tiled
# kernel (tl.dot needs K tiles >= 16) and the CPU op (groups 32..256) cannot take it.
MIN_GROUP_SIZE = 32


def validate_quantization(method: str | None) -> str | None:
    """None or one of QUANTIZATION_METHODS (case-insensitive); ValueError otherwise."""
    if method is None:
        return None
    if not isinstance(method, str) or method.lower() not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {method!r}; use one of {', '.join(QUANTIZATION_METHODS)} or None")
    return method.lower()


def group_size_for(in_features: int, group_size: int) -> int | None:
    """The group size to use for a layer with K = ``in_features``.

    ``group_size`` when it divides K; otherwise the largest power of two dividing both
    (SmolLM2's hidden size 576 = 4.5 x 128 gets 64); None when that is below
    MIN_GROUP_SIZE (the layer then stays dense).
    """
    if group_size < MIN_GROUP_SIZE or group_size & (group_size - 1):
        raise ValueError(f"int4 group size must be a power of two of at least {MIN_GROUP_SIZE}, got {group_size}")
    if in_features % group_size == 0:
        return group_size
    g = math.gcd(in_features, group_size)
    g = 1 << (g.bit_length() - 1)  # a power of two, as both kernels' tiling assumes
    return g if g >= MIN_GROUP_SIZE else None


@dataclass
class QuantizationSummary:
    """What quantize_model did: layer counts and the group sizes actually used."""

    method: str
    quantized: int = 0
    kept_dense: list[str] = field(default_factory=list)
    group_sizes: dict[int, int] = field(default_factory=dict)  # group size -> layers


def quantize_model(
    model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True
) -> QuantizationSummary:
    """Replace every ``nn.Linear`` named in TARGET_LAYERS with an Int8Linear/Int4Linear/Fp8Linear.

    Works in place, one layer at a time: each dense weight is dropped as soon as its
    quantized replacement exists, so the extra memory is one layer's worth at a time.
    Quantizes on the layers' own device (the Int4Linear CPU conversion happens here).
    """
    checked = validate_quantization(method)
    if checked is None:
        raise ValueError("quantize_model needs a method")
    if checked == "gguf":
        raise ValueError("'gguf' reads a GGUF file's own blocks while loading (load_model); "
                         "it cannot quantize a loaded model")
    summary = QuantizationSummary(checked)
    # Names, not modules: a list of modules would keep every dense layer alive until the
    # loop ends, and peak memory would be the dense plus the quantized model.
    for parent_name in [name for name, _ in model.named_modules()]:
        parent = model.get_submodule(parent_name)
        for child_name in [name for name, _ in parent.named_children()]:
            child = getattr(parent, child_name)
            if child_name not in TARGET_LAYERS or type(child) is not nn.Linear:
                continue
            full = f"{parent_name}.{child_name}" if parent_name else child_name
            new: nn.Module
            if checked == "int8":
                new = Int8Linear.from_linear(child)
            elif checked == "fp8":
                new = Fp8Linear.from_linear(child)
            else:
                g = group_size_for(child.in_features, group_size)
                if g is None:
                    summary.kept_dense.append(full)
                    continue
                new = Int4Linear.from_linear(child, g, symmetric)
                summary.group_sizes[g] = summary.group_sizes.get(g, 0) + 1
            setattr(parent, child_name, new)  # the dense Linear is freed with its last reference
            summary.quantized += 1
    if summary.kept_dense:
        logger.warning("kept %d layers dense (no usable int4 group size): %s",
                       len(summary.kept_dense), ", ".join(summary.kept_dense[:4]))
    if checked == "int4" and set(summary.group_sizes) - {group_size}:
        logger.info("int4 group sizes used (group size -> layers): %s", summary.group_sizes)
    return summary
