"""The kernels a quantized linear layer can run on CPU.

Eight ways to compute ``x @ W.T`` for an int8 or int4 weight on CPU:

* ``packed``: torch's packed op (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
  with bf16 activations. It reads the quantized bytes directly, so it is fast where a step
  is bound by weight bytes (small M), and compute-bound and slow at large M.
* ``dequant``: the weight is made dense in the activation dtype for this call only, a
  chunk of output rows at a time (``DEQUANT_CHUNK_ELEMENTS``), and multiplied with the
  dense BLAS matmul at batch-invariant tile sizes (``kernels/batch_invariant/cpu_linear.py``, as
  dense layers are). Memory stays quantized.
* ``dense``: the same dense chunks, made once after loading and kept. Fast at large M,
  at the cost of the dense weight's memory.
* ``fp16``: the same dense chunks rounded to fp16 once and kept for fbgemm's fp16 GEMM
  (``kernels/cpu/half_linear.py``), fp32 arithmetic at batch-invariant tile sizes: half the
  bytes of ``dense`` to read. Only with fp32 activations, on builds with fbgemm.
* ``bf16``: the same chunks rounded to bf16 once and kept in oneDNN's blocked layout for
  its bf16 GEMM (``kernels/cpu/half_linear.py``), bf16 activations and output like
  ``packed``. Only with fp32 activations, on CPUs with bf16 instructions.
* ``bf16dot``: the same bf16 rounding and dot products in Cadence's own GEMM
  (``kernels/cpu/bf16_dot.py``), each row summed in one fixed order at any M and an fp32
  output: no tiles, no padding of a batch-1 call. Only with fp32 activations, on CPUs with
  AVX512-BF16.
* ``int8x2dot`` and ``int8dot``: for int4 weights, Cadence's own integer GEMM
  (``kernels/cpu/int8_dot.py``): the weight's own 4-bit codes, exact integer dot products
  per block of 32, each row summed in one fixed order at any M. The activations are
  quantized per block of 32 in two int8 levels (``int8x2dot``: finer than bf16's rounding)
  or one (``int8dot``, as llama.cpp computes its 4-bit blocks: it changes some greedy
  tokens). Only with fp32 activations, on CPUs with AVX2, and only where
  ``--cpu-kernels`` names them.

``dense`` and ``dequant`` run the same matmul calls on bit-identical chunks, so they give
the same bits; ``packed`` rounds activations to bf16, ``fp16`` weights to fp16,
``bf16`` and ``bf16dot`` both, and ``int8x2dot`` and ``int8dot`` quantize activations;
each gives bits of its own. So which kernel a layer runs decides the model's numerics,
and ``engine/quantization/cpu_planner.py`` chooses it by rule, never by timing. A layer runs its one kernel
for every row at any M (each sums a row in an order of its own that the batch does not
change), so greedy output is batch invariant. A layer with no kernel chosen runs its
format's first (``packed``; the int8 LM head, whose logits must not be rounded to bf16,
has no ``packed``).
"""

from __future__ import annotations

PACKED, DEQUANT, DENSE, FP16, BF16, BF16DOT = "packed", "dequant", "dense", "fp16", "bf16", "bf16dot"
INT8X2DOT, INT8DOT = "int8x2dot", "int8dot"
KERNELS = (PACKED, DEQUANT, DENSE, FP16, BF16, BF16DOT, INT8X2DOT, INT8DOT)
# The integer kernels for int4 weights, by name: how many int8 levels quantize activations.
INT_DOT_LEVELS = {INT8X2DOT: 2, INT8DOT: 1}
# The kernels that read a half-precision copy made once and kept, by their format's name.
HALF_KERNELS = (FP16, BF16, BF16DOT)
# The kernels that read a copy made once and kept (memory the planner budgets).
HELD_KERNELS = (DENSE, *HALF_KERNELS, *INT_DOT_LEVELS)
# The values of ``--cpu-kernels``: one kernel by name, or the planner's rule.
CPU_KERNEL_MODES = ("auto", *KERNELS)


def validate_cpu_kernels(mode: str) -> str:
    """A mode name; ValueError otherwise."""
    if mode not in CPU_KERNEL_MODES:
        raise ValueError(f"cpu_kernels must be one of {', '.join(CPU_KERNEL_MODES)}, got {mode!r}")
    return mode
