"""Weight-only quantization of dense checkpoints while loading (int8 per channel, int4 per group).

``quantize_model`` swaps a loaded model's projection layers for ``Int8Linear`` /
``Int4Linear`` (``linear.py``), whose forward runs the Triton GEMMs on CUDA and torch's
packed CPU ops on CPU (``cpu_policy.py`` says which, and why).
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
from cadence.engine.quantization.linear import Int4Linear, Int8Linear

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QUANTIZATION_METHODS",
    "TARGET_LAYERS",
    "Int4Linear",
    "Int8Linear",
    "QuantizationSummary",
    "group_size_for",
    "quantize_model",
    "validate_quantization",
]
