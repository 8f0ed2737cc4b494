"""Weight-only quantization of dense checkpoints while loading (int8 per channel, int4 per group).

``quantize_model`` swaps a loaded model's projection layers for ``Int8Linear`` /
``Int4Linear`` (``linear.py``), whose forward runs the Triton GEMMs on CUDA and torch's
packed CPU ops on CPU (``cpu_policy.py`` says which, and why). Pre-quantized GPTQ/AWQ
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
from cadence.engine.quantization.linear import Int4Linear, Int8Linear

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QUANTIZATION_METHODS",
    "TARGET_LAYERS",
    "CheckpointQuantization",
    "Int4Linear",
    "Int8Linear",
    "QuantizationSummary",
    "group_size_for",
    "parse_quantization_config",
    "quantize_model",
    "validate_quantization",
]
