"""An int4-weight GEMM on integer dot products (AVX2), every row summed in one fixed order.

``x [M, K] @ W.T`` for a weight held as 4-bit codes ``q`` with, for every block of 32
along K, a scale ``s`` and an offset ``o``: ``w = s * q + o`` (a GGUF Q4_1 block, or any
group-wise int4 weight whose groups are whole blocks of 32). The activations are
quantized per row and block of 32 in ``levels`` int8 steps (``int8_quantize.py``):

* one level, as llama.cpp does for its 4-bit models: ``a ~ d1 * q1``, ``d1 = max|a| / 127``;
* two levels: the first level's remainder quantized again, ``a ~ d1 * q1 + d2 * q2``,
  ``d2 = max|a - d1 * q1| / 127``: an error under 1/64,000 of the block's largest value,
  a dot product finer than with bf16's rounding of every value, for twice the integer work.

Per output and block, in block order, ``acc += sum over levels (s * sum(q * q_l)) * d_l +
o * total``, where ``total`` is the sum of the quantized activations (``sum d_l *
sum(q_l)``). The integer sums are exact and the fp32 steps the same for every row at any
M, on any thread: a row has the bits it would have alone, by construction. The offset
term takes the quantized activations' sum, not the exact one: then both terms are the
weight's values times one vector, whose error is ``w . (a - a_quantized)``; with the
exact sum it would be ``s * q . (a - a_quantized)``, and ``s * q`` is the weight before
its offset centres it, several times larger (bench/RESULTS.md has the perplexities).

Why: where the CPU has no bf16 dot products (AVX2), the other kernels multiply in fp32
FMAs; ``vpmaddubsw`` does four times the multiply-adds per instruction, and the codes
stay 4-bit (with a scale and offset per 32, three quarters of a byte per weight to read,
where fp16 copies take two).

The weight is packed once in blocks of 16 output columns, two 8-lane vectors: for each
block of 32 along K, four 32-byte rows per vector whose low nibbles hold K offsets
``8p .. 8p+3`` and high nibbles ``8p+4 .. 8p+7`` of its 8 columns (four bytes a column),
and beside them the block's 16 scales and 16 offsets in fp32. numba runs the column
blocks on its threads (``numba_runtime.py``), each over the rows ``TILE_ROWS`` at a time.

The register tile (``_microkernel``, LLVM IR built through numba's ``intrinsic``) keeps a
tile's 2 x rows fp32 accumulators (8 lanes each) in registers across K's blocks. Per K
block, level and row, ``vpmaddubsw`` multiplies the unsigned codes by the signed int8
values in pairs to int16 (four K offsets per output lane; the low nibbles, then the high),
eight products summed in int16 (at most 8 x 2 x 15 x 127 = 30,480: no overflow), then
``vpmaddwd`` by ones to int32; then per output, in this order, ``acc = fma(float(sum_l) *
s, d_l, acc)`` for each level and ``acc = fma(o, total, acc)``. It lives in this file, not
its own: numba's disk cache checks only the stamp of the file that defines the kernel.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence.kernels.cpu import int8_quantize
from cadence.kernels.cpu.int8_quantize import quantize, quantize_ready
from cadence.kernels.cpu.numba_runtime import NumbaKernel

# K per block, spelled out here: the register tile below is compiled with it, and numba's
# disk cache checks only this file's stamp.
BLOCK = 32
if int8_quantize.BLOCK != BLOCK:
    raise ImportError(f"the quantizer's blocks of {int8_quantize.BLOCK} are not the GEMM's {BLOCK}")

BLOCK_COLUMNS = 16  # output columns per packed block: two 8-lane vectors
VECTORS = BLOCK_COLUMNS // 8
STEPS = 4  # 32-byte code rows per vector and K block: 8 K each, low nibbles then high
BLOCK_BYTES = VECTORS * STEPS * 32  # code bytes of one column block's K block
WORDS_PER_BLOCK = BLOCK // 4  # int32 words of one row's int8 activations per K block
TILE_ROWS = 4  # rows of x per register tile

# CPU names numba may be told to compile for (NUMBA_CPU_NAME) that have AVX2: LLVM aborts
# the process, uncatchably, on an intrinsic its target lacks.
_AVX2_CPU_NAMES = frozenset(
    "haswell core-avx2 broadwell skylake skylake-avx512 skx cascadelake cooperlake cannonlake icelake-client "
    "icelake-server rocketlake tigerlake alderlake raptorlake meteorlake sapphirerapids emeraldrapids "
    "graniterapids znver1 znver2 znver3 znver4 znver5 x86-64-v3 x86-64-v4".split()
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
    return _avx2_target_refusal() is None and _kernel.function() is not None and quantize_ready()


def _target_has_avx2() -> None:
    """RuntimeError unless the host has AVX2 and numba compiles for a CPU with AVX2."""
    refusal = _avx2_target_refusal()
    if refusal is not None:
        raise RuntimeError(refusal)


@functools.cache
def _avx2_target_refusal() -> str | None:
    """Why the kernel must not be compiled here (None: it may). Asked once: the host's
    features come from CPUID, slow on some virtual machines."""
    try:
        from llvmlite import binding  # type: ignore[import-untyped]
        from numba.core import config
    except ImportError as exc:
        return f"numba is missing: {exc}"
    name, features = config.CPU_NAME, config.CPU_FEATURES  # type: ignore[attr-defined]
    if name not in (None, "host") and name not in _AVX2_CPU_NAMES:
        return f"numba is told to compile for {name!r}, not known to have AVX2"
    if features is not None:
        flags = set(features.split(","))
        if "+avx2" not in flags or flags & {"-avx2", "-avx", "-fma"}:
            return "numba is told to compile without AVX2 (NUMBA_CPU_FEATURES)"
    if not config.ENABLE_AVX or not binding.get_host_cpu_features().get("avx2", False):  # type: ignore[attr-defined]
        return "the host CPU does not report AVX2 (or numba's AVX is off)"
    return None


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
    _tile4, _tile3, _tile2, _tile1 = (_microkernel(rows) for rows in range(TILE_ROWS, 0, -1))
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


# ---------------------------------------------------------------- the register tile


def _microkernel(rows: int) -> Any:
    """An intrinsic ``tile(qa, qa_at, qa_stride, fields, f_at, kb, levels, codes, scales,
    block, out, out_at, out_stride)``: ``out[r, 0:16]`` for ``rows`` rows (element offsets
    and row strides of each array, ``kb`` blocks of K, ``block`` the column block)."""
    from llvmlite import ir
    from numba import types as nt
    from numba.core import cgutils
    from numba.extending import intrinsic

    i8, i16, i32, i64, f32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64), ir.FloatType()
    bytes32, shorts, words, lanes = (
        ir.VectorType(i8, 32),
        ir.VectorType(i16, 16),
        ir.VectorType(i32, 8),
        ir.VectorType(f32, 8),
    )

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        qa, qa_at, qa_stride, fields, f_at, kb, levels, codes, scales, block, out, out_at, out_stride = args
        arrays = signature.args

        def const(value: int) -> Any:
            return ir.Constant(i64, value)

        def data(index: int, array: Any) -> Any:
            return context.make_array(arrays[index])(context, builder, array).data

        def splat(value: Any, vector: Any, count: int) -> Any:
            spread = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(i32, 0))
            mask = ir.Constant(ir.VectorType(i32, count), [0] * count)
            return builder.shuffle_vector(spread, ir.Constant(vector, None), mask)

        module = builder.module
        maddubs = cgutils.get_or_insert_function(
            module, ir.FunctionType(shorts, [bytes32, bytes32]), "llvm.x86.avx2.pmadd.ub.sw"
        )
        maddwd = cgutils.get_or_insert_function(
            module, ir.FunctionType(words, [shorts, shorts]), "llvm.x86.avx2.pmadd.wd"
        )
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(lanes, [lanes, lanes, lanes]), "llvm.fma.v8f32")
        low_mask = ir.Constant(bytes32, [0x0F] * 32)
        ones, four = ir.Constant(shorts, [1] * 16), ir.Constant(shorts, [4] * 16)
        zero = ir.Constant(lanes, [0.0] * 8)

        code_base = builder.gep(data(7, codes), [builder.mul(block, builder.mul(kb, const(BLOCK_BYTES)))])
        scale_base = builder.gep(data(8, scales), [builder.mul(block, builder.mul(kb, const(2 * BLOCK_COLUMNS)))])
        out_rows = [
            builder.gep(data(10, out), [builder.add(out_at, builder.mul(out_stride, const(r)))]) for r in range(rows)
        ]
        qa_rows = [
            builder.gep(data(0, qa), [builder.add(qa_at, builder.mul(qa_stride, const(r)))]) for r in range(rows)
        ]
        level_words = builder.mul(kb, const(WORDS_PER_BLOCK))  # one level's words in a row

        def emit(count: int, end: Any) -> None:
            """The loop over K blocks for ``count`` levels; on to ``end``. The fp32
            accumulators live in the output rows, read and written once per K block, and
            the registers (16 with AVX2) hold a block's integer sums, codes and activations."""
            width = count + 1  # fields per row and K block: each level's scale, then the total
            field_rows = [
                builder.gep(data(3, fields), [builder.mul(builder.add(f_at, builder.mul(kb, const(r))), const(width))])
                for r in range(rows)
            ]
            targets = [
                builder.bitcast(builder.gep(out_rows[r], [const(8 * v)]), lanes.as_pointer())
                for r in range(rows)
                for v in range(VECTORS)
            ]
            for target in targets:
                builder.store(zero, target, align=4)
            loop = builder.append_basic_block(f"kblocks{count}")
            entry = builder.block
            builder.cbranch(builder.icmp_signed(">", kb, const(0)), loop, end)

            builder.position_at_end(loop)
            b = builder.phi(i64)
            b.add_incoming(const(0), entry)
            code_block = builder.gep(code_base, [builder.mul(b, const(BLOCK_BYTES))])
            block_word = builder.mul(b, const(WORDS_PER_BLOCK))
            row_fields = [builder.gep(field_rows[r], [builder.mul(b, const(width))]) for r in range(rows)]
            products = []  # per level: (row, vector) -> the level's exact block sums, int32
            for level in range(count):
                word = builder.add(builder.mul(level_words, const(level)), block_word)
                sums: dict[tuple[int, int], Any] = {}  # (row, vector) -> int16 sums
                for step in range(STEPS):
                    for v in range(VECTORS):
                        at = builder.gep(code_block, [const((v * STEPS + step) * 32)])
                        raw = builder.load(builder.bitcast(at, bytes32.as_pointer()), align=1)
                        shifted = builder.bitcast(builder.lshr(builder.bitcast(raw, shorts), four), bytes32)
                        nibbles = (builder.and_(raw, low_mask), builder.and_(shifted, low_mask))
                        for r in range(rows):
                            for half in range(2):
                                at = builder.add(word, const(2 * step + half))
                                four_bytes = builder.load(builder.gep(qa_rows[r], [at]), align=4)
                                spread = builder.bitcast(splat(four_bytes, words, 8), bytes32)
                                product = builder.call(maddubs, [nibbles[half], spread])
                                sums[(r, v)] = builder.add(sums[(r, v)], product) if (r, v) in sums else product
                products.append({key: builder.call(maddwd, [total, ones]) for key, total in sums.items()})
            field_block = builder.gep(scale_base, [builder.mul(b, const(2 * BLOCK_COLUMNS))])
            weight = [
                builder.load(builder.bitcast(builder.gep(field_block, [const(at)]), lanes.as_pointer()), align=4)
                for at in range(0, 2 * BLOCK_COLUMNS, 8)
            ]
            w_scale, w_offset = weight[:VECTORS], weight[VECTORS:]
            for r in range(rows):
                row = [
                    splat(builder.load(builder.gep(row_fields[r], [const(f)]), align=4), lanes, 8) for f in range(width)
                ]
                for v in range(VECTORS):
                    target = targets[r * VECTORS + v]
                    value = builder.load(target, align=4)
                    for level in range(count):
                        exact = builder.sitofp(products[level][(r, v)], lanes)
                        value = builder.call(fma, [builder.fmul(exact, w_scale[v]), row[level], value])
                    builder.store(builder.call(fma, [w_offset[v], row[count], value]), target, align=4)
            following = builder.add(b, const(1))
            b.add_incoming(following, builder.block)
            builder.cbranch(builder.icmp_signed("<", following, kb), loop, end)

        one, two = builder.append_basic_block("one_level"), builder.append_basic_block("two_levels")
        end = builder.append_basic_block("end")
        builder.cbranch(builder.icmp_signed("==", levels, const(1)), one, two)
        builder.position_at_end(one)
        emit(1, end)
        builder.position_at_end(two)
        emit(2, end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    # intrinsic reads the typer's parameter names: spell them out.
    def tile(  # numba types in, a signature and its code generator out
        typingctx: Any,
        qa: Any,
        qa_at: Any,
        qa_stride: Any,
        fields: Any,
        f_at: Any,
        kb: Any,
        levels: Any,
        codes: Any,
        scales: Any,
        block: Any,
        out: Any,
        out_at: Any,
        out_stride: Any,
    ) -> tuple[Any, Callable[..., Any]]:
        args = (qa, qa_at, qa_stride, fields, f_at, kb, levels, codes, scales, block, out, out_at, out_stride)
        return nt.void(*args), codegen

    return intrinsic(tile)


_kernel = NumbaKernel("int8 dot", _build)
