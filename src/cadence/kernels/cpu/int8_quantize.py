"""Activations quantized for ``int8_dot.py``'s GEMM: per row and block of 32, in int8 levels.

Level 1 quantizes the values, ``d1 = max|a| / 127`` and ``q1 = round(a * 127 / max|a|)``
(half to even); level 2, where asked, the remainder ``a - d1 * q1`` the same way. Beside
the codes, per block: each level's scale and the quantized values' sum, ``sum over levels
d_l * sum(q_l)``, each integer sum exact and the levels added in order. A row's result
depends on that row alone. A block holding NaN or inf gets the scale NaN (zero codes), so
that its outputs are NaN as a float GEMM's would be; one whose values all lie under about
4e-37 quantizes to zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from cadence.kernels.cpu.numba_runtime import NumbaKernel

BLOCK = 32  # K per block: one scale per row and level
LEVELS = (1, 2)
QMAX = 127.0  # codes in [-127, 127]: the GEMM's pair sums stay within int16
# Below this a block's 127 / peak overflows fp32: such a block (all values under 4e-37)
# quantizes to zeros.
TINY = np.float32(QMAX / np.finfo(np.float32).max)


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


def quantize_ready() -> bool:
    return _quantize.function() is not None


# The first level of one block (an intrinsic, set by ``_build_quantize``): a module global,
# not a closure cell, so that numba's disk cache recognises the kernel in the next process.
_first_level: Any = None


def _build_quantize(parallel: bool, cache: bool) -> Any:
    global _first_level
    from numba import njit, prange
    from numba import types as nt

    _first_level = _first_level_intrinsic()
    signature = nt.void(nt.float32[:, ::1], nt.int8[:, ::1], nt.float32[:, :, ::1])
    zero, top, nan = np.float32(0.0), np.float32(QMAX), np.float32(np.nan)

    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def quantize_rows(x: Any, qa: Any, fields: Any) -> None:  # pragma: no cover - compiled by numba
        k, blocks, levels = np.int64(x.shape[1]), np.int64(fields.shape[1]), np.int64(fields.shape[2] - 1)
        for row in prange(x.shape[0]):
            for b in range(blocks):
                start = b * BLOCK
                at = (row * blocks + b) * (levels + 1)
                total = _first_level(x, row * k + start, qa, row * levels * k + start, fields, at)
                if levels == 2:  # the first level's remainder, quantized the same way
                    peak, finite = zero, True
                    for j in range(start, start + BLOCK):
                        left = x[row, j] - fields[row, b, 0] * np.float32(qa[row, j])
                        peak = max(peak, abs(left))
                        finite = finite and np.isfinite(left)
                    if not finite:  # NaN or inf in the block: its outputs are NaN, as a float GEMM's would be
                        peak = nan
                    inverse = top / peak if peak > TINY else zero
                    codes = 0
                    for j in range(start, start + BLOCK):
                        left = x[row, j] - fields[row, b, 0] * np.float32(qa[row, j])
                        code = np.int8(np.rint(left * inverse))
                        qa[row, k + j] = code
                        codes += np.int32(code)
                    scale = zero if peak <= TINY else peak / top  # NaN stays NaN
                    fields[row, b, 1] = scale
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


_quantize = NumbaKernel("int8 activation quantizer", _build_quantize)


def _first_level_intrinsic() -> Any:
    """An intrinsic ``first_level(x, x_at, qa, qa_at, fields, f_at) -> float32``: the block
    of 32 at flat element ``x_at`` of ``x`` quantized (codes to ``qa`` at ``qa_at``, the
    scale to ``fields`` at ``f_at``), returning ``scale * sum(codes)``. In 8-lane vectors:
    a float loop's max cannot be vectorized without reordering what NaN does, but the
    largest magnitude is the largest of the values' bits with the sign cleared (for such
    bits integer order is float order, inf and NaN above every finite value), an integer
    max; the codes are ``rint(x * 127 / peak)``, each step the scalar form's."""
    from llvmlite import ir  # type: ignore[import-untyped]
    from numba import types as nt
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i32, i64, f32 = ir.IntType(8), ir.IntType(32), ir.IntType(64), ir.FloatType()
    lanes, words, codes8 = ir.VectorType(f32, 8), ir.VectorType(i32, 8), ir.VectorType(i8, 8)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x, x_at, qa, qa_at, fields, f_at = args
        arrays = signature.args

        def data(index: int, array: Any) -> Any:
            return context.make_array(arrays[index])(context, builder, array).data

        def splat(value: Any, vector: Any) -> Any:
            spread = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(spread, ir.Constant(vector, None), ir.Constant(words, [0] * 8))

        def fold(vector: Any, combine: Any) -> Any:
            """The 8 lanes combined pairwise into lane 0: halves, then quarters, then pairs."""
            for width in (4, 2, 1):
                upper = ir.Constant(words, [width + i if i < width else 8 + i for i in range(8)])
                vector = combine(vector, builder.shuffle_vector(vector, ir.Constant(vector.type, None), upper))
            return builder.extract_element(vector, ir.Constant(i32, 0))

        def larger(a: Any, b: Any) -> Any:
            return builder.select(builder.icmp_signed(">", a, b), a, b)

        module = builder.module
        rint = cgutils.get_or_insert_function(module, ir.FunctionType(lanes, [lanes]), "llvm.rint.v8f32")
        source = builder.gep(data(0, x), [x_at])
        values = [
            builder.load(builder.bitcast(builder.gep(source, [ir.Constant(i64, 8 * g)]), lanes.as_pointer()), align=4)
            for g in range(BLOCK // 8)
        ]
        magnitude = ir.Constant(words, [0x7FFFFFFF] * 8)
        largest_bits = None
        for value in values:
            bits = builder.and_(builder.bitcast(value, words), magnitude)
            largest_bits = bits if largest_bits is None else larger(largest_bits, bits)
        largest = fold(largest_bits, larger)
        finite = builder.icmp_signed("<", largest, ir.Constant(i32, 0x7F800000))
        peak = builder.select(finite, builder.bitcast(largest, f32), ir.Constant(f32, float("nan")))
        top, zero, tiny = ir.Constant(f32, QMAX), ir.Constant(f32, 0.0), ir.Constant(f32, float(TINY))
        inverse = builder.select(builder.fcmp_ordered(">", peak, tiny), builder.fdiv(top, peak), zero)
        scale = builder.select(builder.fcmp_ordered("<=", peak, tiny), zero, builder.fdiv(peak, top))
        spread = splat(inverse, lanes)
        target = builder.gep(data(2, qa), [qa_at])
        count = None
        for g, value in enumerate(values):
            scaled = builder.fmul(value, spread)
            # A NaN or inf in the block (peak NaN, inverse 0) gives NaN here: code 0.
            codes = builder.select(
                builder.fcmp_ordered("ord", scaled, scaled),
                builder.fptosi(builder.call(rint, [scaled]), words),
                ir.Constant(words, [0] * 8),
            )
            out = builder.gep(target, [ir.Constant(i64, 8 * g)])
            builder.store(builder.trunc(codes, codes8), builder.bitcast(out, codes8.as_pointer()), align=1)
            count = codes if count is None else builder.add(count, codes)
        summed = fold(count, builder.add)
        builder.store(scale, builder.gep(data(4, fields), [f_at]))
        return builder.fmul(scale, builder.sitofp(summed, f32))

    # intrinsic reads the typer's parameter names: spell them out.
    def first_level(
        typingctx: Any, x: Any, x_at: Any, qa: Any, qa_at: Any, fields: Any, f_at: Any
    ) -> tuple[Any, Callable[..., Any]]:
        return nt.float32(x, x_at, qa, qa_at, fields, f_at), codegen

    return intrinsic(first_level)
