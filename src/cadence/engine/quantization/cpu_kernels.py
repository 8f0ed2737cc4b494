"""The kernels a quantized linear layer can run on CPU.

Eight ways to compute ``x @ W.T`` for an int8 or int4 weight on CPU:

* ``packed``: torch's packed op (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``)
  with bf16 activations. It reads the quantized bytes directly, so it is fast where a step
  is bound by weight bytes (small M), and compute-bound and slow at large M.
* ``dequant``: the weight is made dense in the activation dtype for this call only, a
  chunk of output rows at a time (``DEQUANT_CHUNK_ELEMENTS``), and multiplied with the
  dense BLAS matmul at batch-invariant tile sizes (``kernels/batch_invariant.py``, as
  dense layers are). Memory stays quantized.
* ``dense``: the same dense chunks, made once after loading and kept. Fast at large M,
  at the cost of the dense weight's memory.
* ``fp16``: the same dense chunks rounded to fp16 once and kept for fbgemm's fp16 GEMM
  (``kernels/half_linear.py``), fp32 arithmetic at batch-invariant tile sizes: half the
  bytes of ``dense`` to read. Only with fp32 activations, on builds with fbgemm.
* ``bf16``: the same chunks rounded to bf16 once and kept in oneDNN's blocked layout for
  its bf16 GEMM (``kernels/half_linear.py``), bf16 activations and output like
  ``packed``. Only with fp32 activations, on CPUs with bf16 instructions.
* ``bf16dot``: the same bf16 rounding and dot products in Cadence's own GEMM
  (``kernels/bf16_dot.py``), each row summed in one fixed order at any M and an fp32
  output: no tiles, no padding of a batch-1 call. Only with fp32 activations, on CPUs with
  AVX512-BF16.
* ``int8x2dot`` and ``int8dot``: for int4 weights, Cadence's own integer GEMM
  (``kernels/int8_dot.py``): the weight's own 4-bit codes, exact integer dot products
  per block of 32, each row summed in one fixed order at any M. The activations are
  quantized per block of 32 in two int8 levels (``int8x2dot``: finer than bf16's rounding)
  or one (``int8dot``, as llama.cpp computes its 4-bit blocks: it changes some greedy
  tokens). Only with fp32 activations, on CPUs with AVX2, and only where
  ``--cpu-kernels`` names them.

``dense`` and ``dequant`` run the same matmul calls on bit-identical chunks, so they give
the same bits; ``packed`` rounds activations to bf16, ``fp16`` weights to fp16,
``bf16`` and ``bf16dot`` both, and ``int8x2dot`` and ``int8dot`` quantize activations;
each gives bits of its own. So which kernel a layer runs decides the model's numerics,
and ``cpu_planner.py`` chooses it by rule, never by timing. A layer runs its one kernel
for every row at any M (each sums a row in an order of its own that the batch does not
change), so greedy output is batch invariant. A layer with no kernel chosen runs its
format's first (``packed``; the int8 LM head, whose logits must not be rounded to bf16,
has no ``packed``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cadence.kernels.batch_invariant import invariant_linear
from cadence.kernels.half_linear import FORMATS, HalfWeight, invariant_half_linear, pack, tile_plan

PACKED, DEQUANT, DENSE, FP16, BF16, BF16DOT = "packed", "dequant", "dense", "fp16", "bf16", "bf16dot"
INT8X2DOT, INT8DOT = "int8x2dot", "int8dot"
KERNELS = (PACKED, DEQUANT, DENSE, FP16, BF16, BF16DOT, INT8X2DOT, INT8DOT)
# The integer kernels for int4 weights, by name: how many int8 levels quantize activations.
INT_DOT_LEVELS = {INT8X2DOT: 2, INT8DOT: 1}
# The kernels that read a half-precision copy made once and kept, by their format's name.
HALF_KERNELS = (FP16, BF16, BF16DOT)
# The kernels that read a copy made once and kept (memory the planner budgets).
HELD_KERNELS = (DENSE, *HALF_KERNELS, *INT_DOT_LEVELS)
# The per-call dense copy is made this many weights at a time (output rows in chunks): a
# vocabulary-sized head dequantized whole is a temporary freshly mapped and page-faulted on
# every call, several times slower than chunks of this size (bench/RESULTS.md).
DEQUANT_CHUNK_ELEMENTS = 1 << 21

ChunkMaker = Callable[[int, int], torch.Tensor]  # (start, stop) -> W[start:stop], dense and contiguous


def chunk_bounds(n: int, k: int, row_multiple: int) -> list[tuple[int, int]]:
    """[start, stop) output-row ranges of at most ``DEQUANT_CHUNK_ELEMENTS`` weights each,
    in whole multiples of ``row_multiple`` rows (a weight under that size is one chunk)."""
    rows = max(row_multiple, DEQUANT_CHUNK_ELEMENTS // k // row_multiple * row_multiple)
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def chunked_matmul(x: torch.Tensor, n: int, bounds: Sequence[tuple[int, int]], chunk: ChunkMaker) -> torch.Tensor:
    """``x [M, K] @ W.T`` with ``W``'s row ranges ``bounds`` made by ``chunk``, each through
    ``invariant_linear``: a row's bits do not depend on the batch."""
    return _by_chunk(x, n, bounds, lambda start, stop: invariant_linear(x, chunk(start, stop)))


def _by_chunk(
    x: torch.Tensor,
    n: int,
    bounds: Sequence[tuple[int, int]],
    product: Callable[[int, int], torch.Tensor],
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The ``[M, n]`` output (in ``dtype``, default ``x``'s) from ``product(start, stop)``,
    the output columns of each chunk."""
    if len(bounds) == 1:
        return product(*bounds[0])
    out = torch.empty(x.shape[0], n, dtype=dtype or x.dtype)
    for start, stop in bounds:
        out[:, start:stop] = product(start, stop)
    return out


def held_chunks(bounds: Sequence[tuple[int, int]], chunk: ChunkMaker) -> ChunkMaker:
    """A ``ChunkMaker`` serving chunks made once now (the ``dense`` kernel)."""
    made = {(start, stop): chunk(start, stop) for start, stop in bounds}
    return lambda start, stop: made[(start, stop)]


HeldHalf = dict[tuple[int, int], HalfWeight]  # a half kernel's packed chunks, by row range


def held_half(kernel: str, bounds: Sequence[tuple[int, int]], chunk: ChunkMaker) -> HeldHalf:
    """The copy of ``kernel`` (one of ``HALF_KERNELS``): each chunk of ``bounds`` made once,
    rounded and packed (for a row-independent format, all of them as one weight). ValueError
    where a value does not fit the format or no tile size keeps a chunk's rows invariant."""
    fmt = FORMATS[kernel]
    if fmt.row_independent:
        # One packed weight for the whole layer: one call runs every column block in
        # parallel, where chunks would each be a call of few blocks.
        whole = torch.cat([chunk(start, stop) for start, stop in bounds])
        return {(0, bounds[-1][1]): pack(fmt, whole)}
    held = {}
    for start, stop in bounds:
        dense = chunk(start, stop)
        try:
            packed = pack(fmt, dense)
        except ValueError as exc:
            raise ValueError(f"weight rows {start}:{stop}: {exc}") from None
        if not tile_plan(fmt, stop - start, dense.shape[1]).sizes:
            raise ValueError(f"no batch-invariant {kernel} tiling for {stop - start}x{dense.shape[1]}")
        held[(start, stop)] = packed
    return held


def chunked_half_matmul(x: torch.Tensor, n: int, held: HeldHalf) -> torch.Tensor:
    """``x [M, K] @ W.T`` (fp32 out) through a half kernel's held chunks, each at
    batch-invariant tiles; the activations are cast to the format's input once, not per chunk."""
    if len(held) == 1:
        (weight,) = held.values()
        return invariant_half_linear(x, weight)
    rows = x.to(next(iter(held.values())).fmt.input_dtype)
    return _by_chunk(
        x, n, list(held), lambda start, stop: invariant_half_linear(rows, held[(start, stop)]), torch.float32
    )
