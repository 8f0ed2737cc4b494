"""``--batch-invariant``'s switch: the model's layers told to run their batch-invariant kernels.

What the mode guarantees, and which kernels keep it on CUDA and on CPU, is told in
``kernels/batch_invariant/__init__.py``. ``bench/gpu_decode.py --batch-invariant``
measures what it costs. On CPU the torch paths are batch invariant by themselves under
``--cpu-kernels auto``; there the switch only matters for the Triton backend under the
interpreter (tests).
"""

from __future__ import annotations

from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.quantization.linear_layer import LinearLayer


def make_batch_invariant(model: CausalLM) -> None:
    """Switch every ``LinearLayer`` of ``model``, and its tied head, to their batch-invariant
    kernels (they take effect where Triton serves the layer)."""
    for module in model.modules():
        if isinstance(module, LinearLayer):
            module.batch_invariant = True
    model.batch_invariant = True
