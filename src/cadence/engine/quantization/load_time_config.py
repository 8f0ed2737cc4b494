"""Quantizing a dense checkpoint: the ``--quantization`` choices, int4 group sizes, and the
config that gives each decoder projection its load-time method (int8/int4 weight-only, fp8 W8A8)."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

from torch import nn

from cadence.engine.quantization.fp8_linear import Fp8Method
from cadence.engine.quantization.linear import Int4Method, Int8Method
from cadence.engine.quantization.linear_layer import (
    DenseMethod,
    LinearLayer,
    QuantConfig,
    QuantMethod,
)

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


def load_time_method(
    method: str, in_features: int, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True
) -> QuantMethod | None:
    """The method that quantizes a dense projection with K = ``in_features`` as it loads;
    None where int4 has no usable group size (the layer then stays dense)."""
    if method == "int8":
        return Int8Method()
    if method == "fp8":
        return Fp8Method()
    group = group_size_for(in_features, group_size)
    return None if group is None else Int4Method(group, symmetric)


class LoadTimeConfig(QuantConfig):
    """``--quantization int8|int4|fp8`` on a dense checkpoint: each decoder projection is
    loaded dense and quantized as soon as loading ends (``process_after_loading``)."""

    def __init__(self, method: str, group_size: int = DEFAULT_GROUP_SIZE, symmetric: bool = True) -> None:
        self.method, self.group_size, self.symmetric = method, group_size, symmetric

    def linear_method(self, prefix: str, shard_names: tuple[str, ...], input_size: int) -> QuantMethod:
        method = load_time_method(self.method, input_size, self.group_size, self.symmetric)
        if method is None:
            logger.warning(
                "%s stays dense: K=%d has no int4 group size of at least %d", prefix, input_size, MIN_GROUP_SIZE
            )
            return DenseMethod()
        return method


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
    """Quantize an already loaded model's dense decoder projections in place.

    The same methods as loading with ``quantization=`` (each dense layer is handed to the
    method's ``process_after_loading``), for tools and tests that start from a dense model.
    One layer at a time: each dense weight is dropped as soon as its quantized form
    exists, so the extra memory is one layer's worth.
    """
    checked = validate_quantization(method)
    if checked is None:
        raise ValueError("quantize_model needs a method")
    if checked == "gguf":
        raise ValueError(
            "'gguf' reads a GGUF file's own blocks while loading (load_model); it cannot quantize a loaded model"
        )
    summary = QuantizationSummary(checked)
    for name, layer in model.named_modules():
        if name.rsplit(".", 1)[-1] not in TARGET_LAYERS or not isinstance(layer, LinearLayer):
            continue
        if type(layer.method) is not DenseMethod:
            continue
        chosen = load_time_method(checked, layer.in_features, group_size, symmetric)
        if chosen is None:
            summary.kept_dense.append(name)
            continue
        layer.method = chosen
        chosen.process_after_loading(layer)
        if isinstance(chosen, Int4Method):
            summary.group_sizes[chosen.group_size] = summary.group_sizes.get(chosen.group_size, 0) + 1
        summary.quantized += 1
    if summary.kept_dense:
        logger.warning(
            "kept %d layers dense (no usable int4 group size): %s",
            len(summary.kept_dense),
            ", ".join(summary.kept_dense[:4]),
        )
    return summary
