"""``--batch-invariant``: greedy tokens that do not depend on the batch a request runs in.

On a GPU a token's logits change in their last bits with the batch around it, and a
greedy decode can then take another token: cuBLAS and the quantized GEMMs choose their
kernel, tile and split-K by the number of rows, and the attention kernel its split-KV
count and tile shape by the batch. In batch-invariant mode every op whose per-row result
could depend on the batch runs one configuration for every batch:

* dense linears (and a dense tied LM head): ``kernels/batch_invariant_gemm.py``, one tile
  shape, no split-K, K summed in one order;
* int8 / int4 / fp8 linears (GGUF and GPTQ/AWQ included): their tiled Triton GEMM with
  the same fixed M tile and no split-K, never the GEMV, the dequantize-then-cuBLAS path
  or ``_scaled_mm`` (``batch_invariant`` of ``w8a16_matmul`` / ``w4a16_matmul`` /
  ``fp8_matmul``);
* attention: the Triton backend's ``batch_invariant``: no split-KV, the same tiles for a
  decode as for a prefill chunk, so a token's output is the same alone, in a batch, in a
  decode step or in any chunking of its prompt;
* RMSNorm, rotary, SiLU-and-mul and the KV-cache write are one program per row (or
  token) already, and CUDA graphs pad the batch with rows of their own, which no real
  row reads.

It costs the split-K and split-KV parallelism that fills a GPU at small batches, and
cuBLAS's tuned kernels at large ones (``bench/gpu_decode.py --batch-invariant`` measures
it). On CPU the torch paths are batch invariant by themselves under ``--cpu-kernels
auto``; there the switch only matters for the Triton backend under the interpreter (tests).
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
