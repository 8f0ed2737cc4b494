"""Weight formats behind one interface: each ``LinearLayer`` is created, loaded, finalised
and applied by its ``QuantMethod`` (``linear_layer.py``), chosen while the model is built by a
``QuantConfig``:

* ``DenseConfig``: dense projections (``DenseMethod``);
* ``LoadTimeConfig``: ``--quantization int8|int4|fp8`` quantizes a dense checkpoint as it
  loads (``Int8Method`` / ``Int4Method`` in ``linear.py``, ``Fp8Method`` in ``fp8_linear.py``);
* ``CheckpointConfig``: GPTQ/AWQ int4 checkpoints (``checkpoint.py``);
* ``GgufNativeConfig``: a GGUF file's own Q4_0/Q4_1/Q8_0 blocks (``gguf_native.py``);
* the LM head's method on any of them: the int8 head (``lm_head.py``).

On CUDA the methods run the Triton GEMMs (or ``torch._scaled_mm`` for fp8), on CPU torch
paths (``cpu_planner.py`` measures which). GPTQ calibration (``cadence quantize``)
is a tool, in ``cadence.tools``, outside the serving path.
"""

from cadence.engine.quantization.checkpoint import (
    CheckpointQuantization,
    parse_quantization_config,
)
from cadence.engine.quantization.fp8_linear import Fp8Linear, Fp8Method
from cadence.engine.quantization.linear import (
    Int4Linear,
    Int4Method,
    Int8Linear,
    Int8Method,
)
from cadence.engine.quantization.linear_layer import (
    DenseConfig,
    DenseMethod,
    LinearLayer,
    QuantConfig,
    QuantMethod,
)
from cadence.engine.quantization.load_time_config import (
    DEFAULT_GROUP_SIZE,
    QUANTIZATION_METHODS,
    TARGET_LAYERS,
    LoadTimeConfig,
    QuantizationSummary,
    group_size_for,
    quantize_model,
    validate_quantization,
)

__all__ = [
    "DEFAULT_GROUP_SIZE",
    "QUANTIZATION_METHODS",
    "TARGET_LAYERS",
    "CheckpointQuantization",
    "DenseConfig",
    "DenseMethod",
    "Fp8Linear",
    "Fp8Method",
    "Int4Linear",
    "Int4Method",
    "Int8Linear",
    "Int8Method",
    "LinearLayer",
    "LoadTimeConfig",
    "QuantConfig",
    "QuantMethod",
    "QuantizationSummary",
    "group_size_for",
    "parse_quantization_config",
    "quantize_model",
    "validate_quantization",
]
