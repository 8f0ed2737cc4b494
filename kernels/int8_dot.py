"""An int4-weight GEMM on integer dot products (AVX2), every row summed in one fixed order.

``x [M, K] @ W.T`` for a weight held as 4-bit codes ``q`` with, for every block of 32
along K, a scale ``s`` and an offset ``o``: ``w = s * q + o`` (a GGUF Q4_1 block, or any
group-wise int4 weight whose groups are whole blocks of 32). The activations are
quantized per row and block of 32 to int8, ``a ~ d * qa`` with ``d = max|a| / 127``,
as llama.cpp does for its 4-bit models. Then, per output and block, in block order:

    acc += (s * sum(q * qa)) * d + o * sum(a)

``sum(q * qa)`` is exact integer arithmetic: ``vpmaddubsw`` multiplies unsigned codes
by signed activations in pairs to int16 (at most 2 * 15 * 127 each, eight of them
summed: no overflow), ``vpmaddwd`` widens to int32. ``sum(a)`` is the block's fp32 sum
of the activations as they came, so the offset term carries no activation rounding. The
fp32 steps are the same for every row, at any M, on any thread: a row has the bits it
would have alone, by construction.

Why: where the CPU has no bf16 dot products (AVX2), the other kernels multiply in fp32
FMAs; ``vpmaddubsw`` does four times the multiply-adds per instruction, and the codes
stay 4-bit (half a byte per weight to read, where fp16 copies take two).

The weight is packed once in blocks of 16 output columns, two 8-lane vectors: for each
block of 32 along K, four 32-byte rows per vector whose low nibbles hold K offsets
``8p .. 8p+3`` and high nibbles ``8p+4 .. 8p+7`` of its 8 columns (four bytes a column),
and beside them the block's 16 scales and 16 offsets in fp32. The microkernel is LLVM IR
built through numba (``numba.extending.intrinsic``) around the AVX2 intrinsics, a
register tile of ``TILE_ROWS`` rows by 16 columns; numba runs the column blocks on its
threads (``numba_runtime.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence.kernels.numba_runtime import NumbaKernel

BLOCK = 32  # K per scale: one activation scale and one weight scale and offset
BLOCK_COLUMNS = 16  # output columns per packed block: two 8-lane vectors
VECTORS = BLOCK_COLUMNS // 8
STEPS = 4  # 32-byte code rows per vector and K block: 8 K each, low nibbles then high
BLOCK_BYTES = VECTORS * STEPS * 32  # code bytes of one column block's K block
TILE_ROWS = 4  # rows of x per register tile
QMAX = 127.0  # activations quantize to [-127, 127]: a pair sum stays within int16

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


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (fp32, K a multiple of 32) -> (``qa`` int8 ``[M, K]``, ``[M, K / 32, 2]``
    fp32 of each block's scale ``d`` and the sum of its activations), as ``gemm`` computes them."""
    m, k = x.shape
    qa = torch.empty(m, k, dtype=torch.int8)
    fields = torch.empty(m, k // BLOCK, 2, dtype=torch.float32)
    if m:
        _quantize(x.contiguous().numpy(), qa.numpy(), fields.numpy())
    return qa, fields


def gemm(x: torch.Tensor, weight: DotWeight) -> torch.Tensor:
    """``x [M, K]`` (fp32) times the packed weight: ``[M, N]`` fp32."""
    m, k = x.shape
    if k != weight.in_features or x.dtype != torch.float32:
        raise ValueError(f"x must be fp32 with {weight.in_features} columns, got {x.dtype} with {k}")
    columns = weight.codes.shape[0] * BLOCK_COLUMNS
    out = torch.empty(m, columns, dtype=torch.float32)
    if m:
        qa, fields = quantize(x)
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
    _tile4, _tile3, _tile2, _tile1 = (_microkernel(rows) for rows in range(TILE_ROWS, 0, -1))
    matrix = nt.float32[:, ::1]
    signature = nt.void(nt.int32[:, ::1], nt.float32[:, :, ::1], nt.uint8[:, ::1], matrix, matrix)

    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def dot_gemm(qa: Any, fields: Any, codes: Any, scales: Any, out: Any) -> None:  # pragma: no cover - numba
        m, kb = qa.shape[0], np.int64(fields.shape[1])
        words = np.int64(qa.shape[1])
        stride = np.int64(out.shape[1])
        for block in prange(codes.shape[0]):
            o = np.int64(block) * BLOCK_COLUMNS
            row = 0
            while row + TILE_ROWS <= m:
                _tile4(
                    qa, row * words, words, fields, row * kb, kb, codes, scales, block, out, row * stride + o, stride
                )
                row += TILE_ROWS
            left = m - row
            at = row * stride + o
            if left == 3:
                _tile3(qa, row * words, words, fields, row * kb, kb, codes, scales, block, out, at, stride)
            elif left == 2:
                _tile2(qa, row * words, words, fields, row * kb, kb, codes, scales, block, out, at, stride)
            elif left == 1:
                _tile1(qa, row * words, words, fields, row * kb, kb, codes, scales, block, out, at, stride)

    # A check that the kernel computes what it should: all-ones codes, scale 1, offset 0.5.
    probe = pack(torch.ones(16, 32, dtype=torch.uint8), torch.ones(16, 1), torch.full((16, 1), 0.5))
    out = np.zeros((1, BLOCK_COLUMNS), np.float32)
    qa = np.full((1, 8), 0x7F7F7F7F, np.int32)  # every activation 127 at scale 1
    dot_gemm(qa, np.array([[[1.0, 64.0]]], np.float32), probe.codes, probe.scales, out)
    if not np.array_equal(out[0], np.full(16, 127.0 * 32 + 32.0, np.float32)):
        raise RuntimeError(f"the int8 dot kernel computed a wrong product: {out[0]}")
    return dot_gemm


def _build_quantize(parallel: bool, cache: bool) -> Any:
    from numba import njit, prange
    from numba import types as nt

    signature = nt.void(nt.float32[:, ::1], nt.int8[:, ::1], nt.float32[:, :, ::1])
    zero, top = np.float32(0.0), np.float32(QMAX)

    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def quantize_rows(x: Any, qa: Any, fields: Any) -> None:  # pragma: no cover - compiled by numba
        for row in prange(x.shape[0]):
            for b in range(fields.shape[1]):
                start = b * BLOCK
                peak, total = zero, zero
                for j in range(BLOCK):  # in order: the sum's bits are the row's alone
                    value = x[row, start + j]
                    peak = max(peak, abs(value))
                    total += value
                inverse = top / peak if peak > zero else zero
                for j in range(BLOCK):
                    qa[row, start + j] = np.int8(np.rint(x[row, start + j] * inverse))
                fields[row, b, 0] = peak / top
                fields[row, b, 1] = total

    probe = np.arange(-16, 16, dtype=np.float32).reshape(1, 32)
    qa = np.zeros((1, 32), np.int8)
    fields = np.zeros((1, 1, 2), np.float32)
    quantize_rows(probe, qa, fields)
    if qa[0, 0] != -127 or fields[0, 0, 1] != -16.0:
        raise RuntimeError("the int8 activation quantizer computed a wrong value")
    return quantize_rows


def _microkernel(rows: int) -> Any:
    """An intrinsic: ``out[r, 0:16]`` for ``rows`` rows from their int8 blocks and one
    column block's codes, the fp32 accumulators in registers for the whole K."""
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
        qa, qa_at, qa_stride, fields, f_at, kb, codes, scales, block, out, out_at, out_stride = args
        arrays = signature.args

        def const(value: int) -> Any:
            return ir.Constant(i64, value)

        def data(index: int, array: Any) -> Any:
            return context.make_array(arrays[index])(context, builder, array).data

        def splat(value: Any, vector: Any, count: int) -> Any:
            spread = builder.insert_element(ir.Constant(vector, None), value, ir.Constant(i32, 0))
            return builder.shuffle_vector(
                spread, ir.Constant(vector, None), ir.Constant(ir.VectorType(i32, count), [0] * count)
            )

        module = builder.module
        maddubs = cgutils.get_or_insert_function(
            module, ir.FunctionType(shorts, [bytes32, bytes32]), "llvm.x86.avx2.pmadd.ub.sw"
        )
        maddwd = cgutils.get_or_insert_function(
            module, ir.FunctionType(words, [shorts, shorts]), "llvm.x86.avx2.pmadd.wd"
        )
        fma = cgutils.get_or_insert_function(module, ir.FunctionType(lanes, [lanes, lanes, lanes]), "llvm.fma.v8f32")
        low_mask = ir.Constant(bytes32, [0x0F] * 32)
        ones = ir.Constant(shorts, [1] * 16)
        four = ir.Constant(shorts, [4] * 16)

        qa_rows = [
            builder.gep(data(0, qa), [builder.add(qa_at, builder.mul(qa_stride, const(r)))]) for r in range(rows)
        ]
        field_rows = [
            builder.gep(data(3, fields), [builder.mul(builder.add(f_at, builder.mul(kb, const(r))), const(2))])
            for r in range(rows)
        ]
        code_base = builder.gep(data(6, codes), [builder.mul(block, builder.mul(kb, const(BLOCK_BYTES)))])
        scale_base = builder.gep(data(7, scales), [builder.mul(block, builder.mul(kb, const(2 * BLOCK_COLUMNS)))])

        zero = ir.Constant(lanes, [0.0] * 8)
        entry = builder.block
        loop, done = builder.append_basic_block("kblocks"), builder.append_basic_block("store")
        builder.cbranch(builder.icmp_signed(">", kb, const(0)), loop, done)

        builder.position_at_end(loop)
        b = builder.phi(i64)
        b.add_incoming(const(0), entry)
        acc = [builder.phi(lanes) for _ in range(rows * VECTORS)]
        for a in acc:
            a.add_incoming(zero, entry)
        sums: list[list[Any]] = [[None] * VECTORS for _ in range(rows)]
        code_block = builder.gep(code_base, [builder.mul(b, const(BLOCK_BYTES))])
        for step in range(STEPS):
            nibbles = []
            for v in range(VECTORS):
                at = builder.gep(code_block, [const((v * STEPS + step) * 32)])
                raw = builder.load(builder.bitcast(at, bytes32.as_pointer()), align=1)
                shifted = builder.bitcast(builder.lshr(builder.bitcast(raw, shorts), four), bytes32)
                nibbles.append((builder.and_(raw, low_mask), builder.and_(shifted, low_mask)))
            for r in range(rows):
                word = builder.add(builder.mul(b, const(BLOCK // 4)), const(2 * step))
                for half in range(2):
                    four_bytes = builder.load(builder.gep(qa_rows[r], [builder.add(word, const(half))]), align=4)
                    spread = builder.bitcast(splat(four_bytes, words, 8), bytes32)
                    for v in range(VECTORS):
                        product = builder.call(maddubs, [nibbles[v][half], spread])
                        sums[r][v] = product if sums[r][v] is None else builder.add(sums[r][v], product)
        field_block = builder.gep(scale_base, [builder.mul(b, const(2 * BLOCK_COLUMNS))])
        weight_fields = []
        for field in range(2):
            for v in range(VECTORS):
                at = builder.gep(field_block, [const(field * BLOCK_COLUMNS + v * 8)])
                weight_fields.append(builder.load(builder.bitcast(at, lanes.as_pointer()), align=4))
        w_scale, w_offset = weight_fields[:VECTORS], weight_fields[VECTORS:]
        summed = []
        for r in range(rows):
            row_field = builder.gep(field_rows[r], [builder.mul(b, const(2))])
            d = splat(builder.load(row_field, align=4), lanes, 8)
            total = splat(builder.load(builder.gep(row_field, [const(1)]), align=4), lanes, 8)
            for v in range(VECTORS):
                exact = builder.sitofp(builder.call(maddwd, [sums[r][v], ones]), lanes)
                scaled = builder.fmul(exact, w_scale[v])
                step_acc = builder.call(fma, [scaled, d, acc[r * VECTORS + v]])
                summed.append(builder.call(fma, [w_offset[v], total, step_acc]))
        following = builder.add(b, const(1))
        tail = builder.block
        b.add_incoming(following, tail)
        for a, s in zip(acc, summed):
            a.add_incoming(s, tail)
        builder.cbranch(builder.icmp_signed("<", following, kb), loop, done)

        builder.position_at_end(done)
        results = []
        for s in summed:
            result = builder.phi(lanes)
            result.add_incoming(zero, entry)
            result.add_incoming(s, tail)
            results.append(result)
        out_data = data(9, out)
        for r in range(rows):
            row_out = builder.gep(out_data, [builder.add(out_at, builder.mul(out_stride, const(r)))])
            for v in range(VECTORS):
                target = builder.bitcast(builder.gep(row_out, [const(8 * v)]), lanes.as_pointer())
                builder.store(results[r * VECTORS + v], target, align=4)
        return context.get_dummy_value()

    # intrinsic reads the typer's parameter names: spell them out.
    def tile(typingctx, qa, qa_at, qa_stride, fields, f_at, kb, codes, scales, block, out, out_at, out_stride):
        args = (qa, qa_at, qa_stride, fields, f_at, kb, codes, scales, block, out, out_at, out_stride)
        return nt.void(*args), codegen

    return intrinsic(tile)


_kernel = NumbaKernel("int8 dot", _build)
_quantize = NumbaKernel("int8 activation quantizer", _build_quantize)
