"""Quantization of dense checkpoints while loading: int8 per channel, int4 per group
(weight-only), and fp8 W8A8 (e4m3 weights per channel, activations per token).

``quantize_model`` swaps a loaded model's projection layers for ``Int8Linear`` /
``Int4Linear`` (``linear.py``) or ``Fp8Linear`` (``fp8_linear.py``), whose forward runs
the Triton GEMMs (or ``torch._scaled_mm`` for fp8) on CUDA and torch paths on CPU
(``cpu_policy.py`` says which, and why). Pre-quantized GPTQ/AWQ
int4 checkpoints load natively into ``Int4Linear`` (``checkpoint.py``).
"""
from cadence.engine.quantization.apply import (
    DEFAULT_GROUP_SIZE,
    QUANTIZATION_METHODS,
    TARGET_LAYERS,
    QuantizationSummary,
    group_size_for,
    quantize_model,
    validate_quantization,
)
from cadence.engine.quantization.checkpoint import CheckpointQuantization, parse_quantization_config
from cadence.engine.quantization.fp8_linear import Fp8Linear
from cadence.engine.quantization.linear import Int4Linear, Int8Linear

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QUANTIZATION_METHODS",
    "TARGET_LAYERS",
    "CheckpointQuantization",
    "Fp8Linear",
    "Int4Linear",
    "Int8Linear",
    "QuantizationSummary",
    "group_size_for",
    "parse_quantization_config",
    "quantize_model",
    "validate_quantization",
]
