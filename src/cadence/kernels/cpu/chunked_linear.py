"""The chunked matmuls of the CPU kernels that read a dense or half-precision copy of a
quantized weight (``dequant``, ``dense``, ``fp16``, ``bf16``, ``bf16dot``: see
``kernel_names.py``).

A weight is made dense a chunk of output rows at a time (``DEQUANT_CHUNK_ELEMENTS``
weights): per call for ``dequant``, once and kept for ``dense``, and rounded and packed
once for the half kernels. Each chunk goes through a batch-invariant GEMM
(``invariant_linear``, or ``invariant_half_linear`` at the format's verified tiles), so a
row's bits do not depend on the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from cadence.kernels.batch_invariant.cpu_linear import invariant_linear
from cadence.kernels.cpu.half_linear import FORMATS, HalfWeight, invariant_half_linear, pack, tile_plan

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
