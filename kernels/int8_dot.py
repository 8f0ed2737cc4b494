"""An int4-weight GEMM on integer dot products (AVX2), every row summed in one fixed order.

``x [M, K] @ W.T`` for a weight held as 4-bit codes ``q`` with, for every block of 32
along K, a scale ``s`` and an offset ``o``: ``w = s * q + o`` (a GGUF Q4_1 block, or any
group-wise int4 weight whose groups are whole blocks of 32). The activations are
quantized per row and block of 32 in ``levels`` int8 steps:

* one level, as llama.cpp does for its 4-bit models: ``a ~ d1 * q1``, ``d1 = max|a| / 127``;
* two levels: the first level's remainder quantized again, ``a ~ d1 * q1 + d2 * q2``,
  ``d2 = max|a - d1 * q1| / 127``: an error under 1/64,000 of the block's largest value,
  finer than bf16's rounding of every value, for twice the integer work.

Per output and block, in block order, ``acc += sum over levels (s * sum(q * q_l)) * d_l +
o * total``, where ``total`` is the sum of the quantized activations (``sum d_l *
sum(q_l)``). The integer sums are exact (``int8_dot_tile.py``) and the fp32 steps the same
for every row at any M, on any thread: a row has the bits it would have alone, by
construction. The offset term takes the quantized activations' sum, not the exact one:
then both terms are the weight's values times one vector, whose error is ``w . (a -
a_quantized)``; with the exact sum it would be ``s * q . (a - a_quantized)``, and ``s * q``
is the weight before its offset centres it, several times larger (one level, measured:
18.48 against 18.21 perplexity on the default model).

Why: where the CPU has no bf16 dot products (AVX2), the other kernels multiply in fp32
FMAs; ``vpmaddubsw`` does four times the multiply-adds per instruction, and the codes
stay 4-bit (half a byte per weight to read, where fp16 copies take two).

The weight is packed once in blocks of 16 output columns, two 8-lane vectors: for each
block of 32 along K, four 32-byte rows per vector whose low nibbles hold K offsets
``8p .. 8p+3`` and high nibbles ``8p+4 .. 8p+7`` of its 8 columns (four bytes a column),
and beside them the block's 16 scales and 16 offsets in fp32. numba runs the column
blocks on its threads (``numba_runtime.py``), each over the rows ``TILE_ROWS`` at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence.kernels.int8_dot_tile import BLOCK, BLOCK_BYTES, BLOCK_COLUMNS, STEPS, VECTORS, microkernel
from cadence.kernels.numba_runtime import NumbaKernel

TILE_ROWS = 4  # rows of x per register tile
QMAX = 127.0  # activations quantize to [-127, 127]: a pair sum stays within int16
LEVELS = (1, 2)

# CPU names numba may be told to compile for (NUMBA_CPU_NAME) that have AVX2: LLVM aborts
# the process, uncatchably, on an intrinsic its target lacks.
_AVX2_CPU_NAMES = frozenset(
    "haswell broadwell skylake skylake-avx512 cascadelake cooperlake icelake-client icelake-server "
    "tigerlake alderlake sapphirerapids znver1 znver2 znver3 znver4 znver5 x86-64-v3 x86-64-v4".split()
)


@dataclass(frozen=True)
class DotWeight:
    """A weight's 4-bit codes packed in blocks of ``BLOCK_COLUMNS`` columns, with scales and offsets."""

    codes: np.ndarray  # uint8 [ceil(N / 16), K / 32 * BLOCK_BYTES]
    scales: np.ndarray  # float32 [ceil(N / 16), K / 32 * 2 * 16]: per K block, 16 scales then 16 offsets
    out_features: int
    in_features: int


def pack(codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> DotWeight:
    """``codes`` uint8 ``[N, K]`` in 0..15, ``scales`` and ``offsets`` ``[N, K / 32]``
    (``w = scale * code + offset``) packed for ``gemm``. K must be a multiple of 32."""
    n, k = codes.shape
    if k % BLOCK or scales.shape != (n, k // BLOCK) or offsets.shape != scales.shape:
        raise ValueError(f"int8dot takes K a multiple of {BLOCK} with a scale and offset per block: {n}x{k}")
    if codes.numel() and int(codes.max()) > 15:
        raise ValueError("int8dot takes 4-bit codes")
    pad = -n % BLOCK_COLUMNS
    kb = k // BLOCK
    blocks = -(-n // BLOCK_COLUMNS)
    padded = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    # [block, vector, column, kb, step, half, 4] -> [block, kb, vector, step, column, 4] nibble pairs
    grid = padded.view(blocks, VECTORS, 8, kb, STEPS, 2, 4)
    low, high = grid[..., 0, :], grid[..., 1, :]
    order = (0, 3, 1, 4, 2, 5)  # block, kb, vector, step, column, byte
    packed = (low.permute(order) | (high.permute(order) << 4)).contiguous()
    fields = torch.stack([scales.float(), offsets.float()])  # [2, N, kb]
    fields = torch.nn.functional.pad(fields, (0, 0, 0, pad)).view(2, blocks, BLOCK_COLUMNS, kb)
    fields = fields.permute(1, 3, 0, 2).contiguous()  # [block, kb, field, column]
    return DotWeight(packed.view(blocks, -1).numpy(), fields.view(blocks, -1).numpy(), n, k)


def packed_bytes(out_features: int, in_features: int) -> int:
    blocks = -(-out_features // BLOCK_COLUMNS)
    return blocks * (in_features // BLOCK) * (BLOCK_BYTES + 2 * BLOCK_COLUMNS * 4)


def quantize(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (fp32, K a multiple of 32) -> (``qa`` int8 ``[M, levels * K]``: each
    row's levels one after another, ``[M, K / 32, levels + 1]`` fp32: per block, each
    level's scale and the quantized activations' sum), as ``gemm`` computes them."""
    m, k = x.shape
    if levels not in LEVELS or k % BLOCK:
        raise ValueError(f"levels is one of {LEVELS} and K a multiple of {BLOCK}: {levels}, {k}")
    qa = torch.empty(m, levels * k, dtype=torch.int8)
    fields = torch.empty(m, k // BLOCK, levels + 1, dtype=torch.float32)
    if m:
        _quantize(x.contiguous().numpy(), qa.numpy(), fields.numpy())
    return qa, fields


def gemm(x: torch.Tensor, weight: DotWeight, levels: int) -> torch.Tensor:
    """``x [M, K]`` (fp32), quantized in ``levels`` int8 steps, times the packed weight: ``[M, N]`` fp32."""
    m, k = x.shape
    if k != weight.in_features or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 with {weight.in_features} columns, got {x.dtype} with {k}")
    columns = weight.codes.shape[0] * BLOCK_COLUMNS
    out = torch.empty(m, columns, dtype=torch.float32)
    if m:
        qa, fields = quantize(x, levels)
        _kernel(qa.view(torch.int32).numpy(), fields.numpy(), weight.codes, weight.scales, out.numpy())
    return out if columns == weight.out_features else out[:, : weight.out_features].contiguous()


def hardware_ready() -> bool:
    """Whether the CPU has AVX2, numba compiles for it, and the kernel builds."""
    try:
        _target_has_avx2()
    except (ImportError, RuntimeError):
        return False
    return _kernel.function() is not None and _quantize.function() is not None


def _target_has_avx2() -> None:
    """RuntimeError unless the host has AVX2 and numba compiles for a CPU with AVX2."""
    from llvmlite import binding  # type: ignore[import-untyped]
    from numba.core import config

    name, features = config.CPU_NAME, config.CPU_FEATURES  # type: ignore[attr-defined]
    if name not in (None, "host") and name not in _AVX2_CPU_NAMES:
        raise RuntimeError(f"numba is told to compile for {name!r}, not known to have AVX2")
    if features is not None and ("+avx2" not in features or "-avx2" in features):
        raise RuntimeError("numba is told to compile without AVX2 (NUMBA_CPU_FEATURES)")
    if not config.ENABLE_AVX or not binding.get_host_cpu_features().get("avx2", False):  # type: ignore[attr-defined]
        raise RuntimeError("the host CPU does not report AVX2 (or numba's AVX is off)")


# The register tiles of TILE_ROWS .. 1 rows (intrinsics), set by ``_build``. Module globals,
# not closure cells, so that numba's disk cache recognises the kernel in the next process.
_tile4: Any = None
_tile3: Any = None
_tile2: Any = None
_tile1: Any = None


def _build(parallel: bool, cache: bool) -> Any:
    global _tile4, _tile3, _tile2, _tile1
    from numba import njit, prange
    from numba import types as nt

    _target_has_avx2()
    _tile4, _tile3, _tile2, _tile1 = (microkernel(rows) for rows in range(TILE_ROWS, 0, -1))
    matrix = nt.float32[:, ::1]
    signature = nt.void(nt.int32[:, ::1], nt.float32[:, :, ::1], nt.uint8[:, ::1], matrix, matrix)

    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def dot_gemm(qa: Any, fields: Any, codes: Any, scales: Any, out: Any) -> None:  # pragma: no cover - numba
        m, kb, levels = qa.shape[0], np.int64(fields.shape[1]), np.int64(fields.shape[2] - 1)
        words = np.int64(qa.shape[1])
        stride = np.int64(out.shape[1])
        for block in prange(codes.shape[0]):
            o = np.int64(block) * BLOCK_COLUMNS
            row = 0
            while row + TILE_ROWS <= m:
                at = row * stride + o
                _tile4(qa, row * words, words, fields, row * kb, kb, levels, codes, scales, block, out, at, stride)
                row += TILE_ROWS
            left = m - row
            at = row * stride + o
            if left == 3:
                _tile3(qa, row * words, words, fields, row * kb, kb, levels, codes, scales, block, out, at, stride)
            elif left == 2:
                _tile2(qa, row * words, words, fields, row * kb, kb, levels, codes, scales, block, out, at, stride)
            elif left == 1:
                _tile1(qa, row * words, words, fields, row * kb, kb, levels, codes, scales, block, out, at, stride)

    # A check that both forms compute what they should: all-ones codes, scale 1, offset 0.5,
    # every activation 127 at scale 1 (and a second level of 1s at scale 1/127).
    probe = pack(torch.ones(16, 32, dtype=torch.uint8), torch.ones(16, 1), torch.full((16, 1), 0.5))
    for levels, second in ((1, 0.0), (2, 1.0)):
        out = np.zeros((1, BLOCK_COLUMNS), np.float32)
        qa = np.array([[0x7F7F7F7F] * 8 + [0x01010101] * 8 * (levels - 1)], np.int32)
        level_scales = [1.0, 1.0 / 127.0][:levels]
        total = 127.0 * 32 + 32.0 * second / 127.0
        dot_gemm(qa, np.array([[[*level_scales, total]]], np.float32), probe.codes, probe.scales, out)
        if not np.allclose(out[0], np.full(16, 1.5 * total, np.float32), rtol=1e-6):
            raise RuntimeError(f"the int8 dot kernel computed a wrong product at {levels} levels: {out[0]}")
    return dot_gemm


def _build_quantize(parallel: bool, cache: bool) -> Any:
    from numba import njit, prange
    from numba import types as nt

    signature = nt.void(nt.float32[:, ::1], nt.int8[:, ::1], nt.float32[:, :, ::1])
    zero, top = np.float32(0.0), np.float32(QMAX)

    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def quantize_rows(x: Any, qa: Any, fields: Any) -> None:  # pragma: no cover - compiled by numba
        k, levels = x.shape[1], fields.shape[2] - 1
        for row in prange(x.shape[0]):
            for b in range(fields.shape[1]):
                start = b * BLOCK
                total = zero
                for level in range(levels):
                    # What is left to quantize: the value, or the first level's remainder.
                    peak = zero
                    for j in range(start, start + BLOCK):
                        left = x[row, j] if level == 0 else x[row, j] - fields[row, b, 0] * np.float32(qa[row, j])
                        peak = max(peak, abs(left))
                    inverse = top / peak if peak > zero else zero
                    codes = 0
                    for j in range(start, start + BLOCK):
                        left = x[row, j] if level == 0 else x[row, j] - fields[row, b, 0] * np.float32(qa[row, j])
                        code = np.int8(np.rint(left * inverse))
                        qa[row, level * k + j] = code
                        codes += np.int32(code)
                    scale = peak / top
                    fields[row, b, level] = scale
                    total += scale * np.float32(codes)  # an exact integer sum, then fp32 in level order
                fields[row, b, levels] = total

    for levels in LEVELS:
        probe = np.arange(-16, 16, dtype=np.float32).reshape(1, 32) / np.float32(3.0)
        qa = np.zeros((1, 32 * levels), np.int8)
        fields = np.zeros((1, 1, levels + 1), np.float32)
        quantize_rows(probe, qa, fields)
        restored = sum(fields[0, 0, i] * qa[0, 32 * i : 32 * (i + 1)].astype(np.float32) for i in range(levels))
        if qa[0, 0] != -127 or np.abs(restored - probe[0]).max() > 16 / 3 / 127**levels:
            raise RuntimeError(f"the int8 activation quantizer computed a wrong value at {levels} levels")
    return quantize_rows


_kernel = NumbaKernel("int8 dot", _build)
_quantize = NumbaKernel("int8 activation quantizer", _build_quantize)
