"""A bf16 GEMM for CPUs with AVX512-BF16 whose every row is summed in one fixed order.

``x [M, K] @ W.T``: activations and weight rounded to bf16, products of bf16 pairs summed
in fp32 by ``vdpbf16ps``, an fp32 output (not rounded again). oneDNN's bf16 GEMM does the
same arithmetic, but picks its blocking, and with it each output's sum order, from M, so
it is only batch-invariant at tile sizes measured to agree (``half_linear.py``), pads a
batch-1 call to them, and rounds its output to bf16.

Here each output is one accumulator that takes the pairs of K in order, whatever M is and
whichever thread runs it: every row has the bits it would have alone, by construction, at
any M, in one call. The weight is packed once into blocks of 32 output columns
(``[N / 32, K / 2, 32]`` int32, each a bf16 pair of one column); a task takes one block
and walks the rows of x six at a time (a register tile of 6 x 32 fp32 accumulators, the
block read from L1/L2 for every tile after the first), so at batch 1 the weight streams
once from memory and at large M the dot products, not the bytes, bound the call.

The microkernel is LLVM IR built through numba (``numba.extending.intrinsic``) around
the ``llvm.x86.avx512bf16.dpbf16ps.512`` intrinsic; numba compiles the loops around it
and runs the blocks on its threads (``numba_runtime.py``). Offered only where the CPU
has AVX512-BF16 (``hardware_ready``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence.kernels.cpu.numba_runtime import NumbaKernel

BLOCK_COLUMNS = 32  # output columns per packed block: two 16-lane fp32 accumulators per row
TILE_ROWS = 6  # rows of x per register tile: 12 accumulators hide the dot product's latency


@dataclass(frozen=True)
class DotWeight:
    """A ``[N, K]`` weight rounded to bf16 and packed in blocks of ``BLOCK_COLUMNS`` columns."""

    blocks: np.ndarray  # int32 [ceil(N / 32), ceil(K / 2), 32]: bf16 pairs, zero-padded
    out_features: int
    in_features: int


def pack(weight: torch.Tensor) -> DotWeight:
    """``weight`` (``[N, K]``, fp32) rounded to bf16 and packed for ``gemm``."""
    n, k = weight.shape
    padded = torch.nn.functional.pad(weight.to(torch.bfloat16), (0, k % 2, 0, -n % BLOCK_COLUMNS))
    pairs = padded.view(-1, BLOCK_COLUMNS, (k + 1) // 2, 2).permute(0, 2, 1, 3).contiguous()
    return DotWeight(pairs.view(torch.int32).squeeze(-1).numpy(), n, k)


def unpack(weight: DotWeight) -> torch.Tensor:
    """The ``[N, K]`` bf16 weight ``pack`` rounded and packed (what the kernel multiplies by)."""
    blocks = torch.from_numpy(weight.blocks).view(torch.bfloat16)  # [N / 32, K / 2, 64]
    pairs = blocks.view(blocks.shape[0], blocks.shape[1], BLOCK_COLUMNS, 2).permute(0, 2, 1, 3)
    dense = pairs.reshape(-1, blocks.shape[1] * 2)
    return dense[: weight.out_features, : weight.in_features].clone()


def packed_bytes(out_features: int, in_features: int) -> int:
    return -(-out_features // BLOCK_COLUMNS) * BLOCK_COLUMNS * (-(-in_features // 2) * 2) * 2


def gemm(x: torch.Tensor, weight: DotWeight) -> torch.Tensor:
    """``x [M, K]`` (bf16) times the packed weight: ``[M, N]`` fp32."""
    m, k = x.shape
    if k != weight.in_features or x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bf16 with {weight.in_features} columns, got {x.dtype} with {k}")
    if k % 2:
        x = torch.nn.functional.pad(x, (0, 1))
    pairs = x.contiguous().view(torch.int32)
    columns = weight.blocks.shape[0] * BLOCK_COLUMNS
    out = torch.empty(m, columns, dtype=torch.float32)
    if m:
        _kernel(pairs.numpy(), weight.blocks, out.numpy())
    return out if columns == weight.out_features else out[:, : weight.out_features].contiguous()


def linear(x: torch.Tensor, weight: DotWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ W.T + b``: ``x`` rounded to bf16, the product and the bias added in
    fp32, returned in ``x``'s dtype (float32 stays unrounded)."""
    lead = x.shape[:-1]
    y = gemm(x.reshape(-1, weight.in_features).to(torch.bfloat16), weight)
    if bias is not None:
        y += bias.float()
    y = y.reshape(*lead, weight.out_features)
    return y if x.dtype == torch.float32 else y.to(x.dtype)


def hardware_ready() -> bool:
    """Whether the CPU has AVX512-BF16 and numba can build the kernel for it."""
    try:
        _target_has_bf16()
    except (ImportError, RuntimeError):
        return False
    return _kernel.function() is not None


# The register tiles of 6, 5, ... 1 rows (intrinsics), set by ``_build``. Module globals,
# not closure cells, so that numba's disk cache recognises the kernel in the next process.
_tile6: Any = None
_tile5: Any = None
_tile4: Any = None
_tile3: Any = None
_tile2: Any = None
_tile1: Any = None


def _build(parallel: bool, cache: bool) -> Any:
    global _tile6, _tile5, _tile4, _tile3, _tile2, _tile1
    from numba import njit, prange
    from numba import types as nt

    _target_has_bf16()
    _tile6, _tile5, _tile4, _tile3, _tile2, _tile1 = (_microkernel(rows) for rows in range(TILE_ROWS, 0, -1))
    signature = nt.void(nt.int32[:, ::1], nt.int32[:, :, ::1], nt.float32[:, ::1])

    # An explicit signature: the one specialization every call runs.
    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def dot_gemm(x: Any, blocks: Any, out: Any) -> None:  # pragma: no cover - compiled by numba
        m, pairs = x.shape[0], np.int64(x.shape[1])
        stride = np.int64(out.shape[1])
        for block in prange(blocks.shape[0]):
            w = np.int64(block) * pairs * BLOCK_COLUMNS
            row = 0
            while row + TILE_ROWS <= m:
                _tile6(x, row * pairs, pairs, blocks, w, out, row * stride + block * BLOCK_COLUMNS, stride, pairs)
                row += TILE_ROWS
            left = m - row
            o = row * stride + block * BLOCK_COLUMNS
            if left == 5:
                _tile5(x, row * pairs, pairs, blocks, w, out, o, stride, pairs)
            elif left == 4:
                _tile4(x, row * pairs, pairs, blocks, w, out, o, stride, pairs)
            elif left == 3:
                _tile3(x, row * pairs, pairs, blocks, w, out, o, stride, pairs)
            elif left == 2:
                _tile2(x, row * pairs, pairs, blocks, w, out, o, stride, pairs)
            elif left == 1:
                _tile1(x, row * pairs, pairs, blocks, w, out, o, stride, pairs)

    ones = torch.ones(16, 16)
    probe = pack(ones)
    out = np.zeros((1, BLOCK_COLUMNS), np.float32)
    dot_gemm(np.full((1, 8), 0x3F803F80, np.int32), probe.blocks, out)  # bf16 pairs of 1.0
    if not np.array_equal(out[0, :16], np.full(16, 16.0, np.float32)):
        raise RuntimeError("the bf16 dot kernel computed a wrong product")
    return dot_gemm


def _target_has_bf16() -> None:
    """RuntimeError unless numba compiles for the host CPU and the host reports AVX512-BF16:
    LLVM aborts the process, uncatchably, on an instruction its target lacks."""
    from llvmlite import binding  # type: ignore[import-untyped]
    from numba.core import config

    other_cpu = config.CPU_NAME not in (None, "host") or config.CPU_FEATURES is not None  # type: ignore[attr-defined]
    if other_cpu or not config.ENABLE_AVX:  # type: ignore[attr-defined]
        raise RuntimeError("numba is told to compile for another CPU (NUMBA_CPU_NAME, NUMBA_CPU_FEATURES or AVX off)")
    if not binding.get_host_cpu_features().get("avx512bf16", False):
        raise RuntimeError("the host CPU does not report AVX512-BF16")


def _microkernel(rows: int) -> Any:
    """An intrinsic: ``out[r, 0:32] = sum over pairs p of x[r, p] . blocks[p, 0:32]`` for
    ``rows`` rows (offsets in elements), the accumulators in registers for the whole K."""
    from llvmlite import ir
    from numba import types as nt
    from numba.core import cgutils
    from numba.extending import intrinsic

    i32, i64 = ir.IntType(32), ir.IntType(64)
    lanes = ir.VectorType(ir.FloatType(), 16)
    words = ir.VectorType(i32, 16)
    halves = ir.VectorType(_bfloat(), 32)
    per_block = BLOCK_COLUMNS // 16

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        x, x_at, x_stride, blocks, w_at, out, out_at, out_stride, pairs = args
        arrays = signature.args

        def const(value: int) -> Any:
            return ir.Constant(i64, value)

        def data(index: int, array: Any) -> Any:
            return context.make_array(arrays[index])(context, builder, array).data

        def row_start(base: Any, at: Any, stride: Any, row: int) -> Any:
            return builder.gep(base, [builder.add(at, builder.mul(stride, const(row)))])

        dot = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(lanes, [lanes, halves, halves]), "llvm.x86.avx512bf16.dpbf16ps.512"
        )
        x_rows = [row_start(data(0, x), x_at, x_stride, r) for r in range(rows)]
        w_base = builder.bitcast(builder.gep(data(3, blocks), [w_at]), words.as_pointer())
        zero = ir.Constant(lanes, [0.0] * 16)
        entry = builder.block
        loop, done = builder.append_basic_block("pairs"), builder.append_basic_block("store")
        builder.cbranch(builder.icmp_signed(">", pairs, const(0)), loop, done)

        # The loop over K's pairs: each accumulator a PHI, so it stays in a register.
        builder.position_at_end(loop)
        p = builder.phi(i64)
        p.add_incoming(const(0), entry)
        acc = [builder.phi(lanes) for _ in range(rows * per_block)]
        for a in acc:
            a.add_incoming(zero, entry)
        w = []
        for c in range(per_block):
            at = builder.add(builder.mul(p, const(per_block)), const(c))
            w.append(builder.bitcast(builder.load(builder.gep(w_base, [at]), align=4), halves))
        summed = []
        for r in range(rows):
            pair = builder.load(builder.gep(x_rows[r], [p]), align=4)
            spread = builder.insert_element(ir.Constant(words, None), pair, ir.Constant(i32, 0))
            spread = builder.shuffle_vector(spread, ir.Constant(words, None), ir.Constant(words, [0] * 16))
            x_pair = builder.bitcast(spread, halves)
            summed += [builder.call(dot, [acc[r * per_block + c], x_pair, w[c]]) for c in range(per_block)]
        following = builder.add(p, const(1))
        tail = builder.block
        p.add_incoming(following, tail)
        for a, s in zip(acc, summed):
            a.add_incoming(s, tail)
        builder.cbranch(builder.icmp_signed("<", following, pairs), loop, done)

        builder.position_at_end(done)
        results = []
        for s in summed:  # PHIs first in the block, then the stores
            result = builder.phi(lanes)
            result.add_incoming(zero, entry)
            result.add_incoming(s, tail)
            results.append(result)
        out_data = data(5, out)
        for r in range(rows):
            row_out = row_start(out_data, out_at, out_stride, r)
            for c in range(per_block):
                target = builder.bitcast(builder.gep(row_out, [const(16 * c)]), lanes.as_pointer())
                builder.store(results[r * per_block + c], target, align=4)
        return context.get_dummy_value()

    def typer(typingctx: Any, *args: Any) -> Any:
        return nt.void(*args), codegen

    # intrinsic reads the typer's parameter names: spell them out.
    def tile(
        typingctx: Any,
        x: Any,
        x_at: Any,
        x_stride: Any,
        blocks: Any,
        w_at: Any,
        out: Any,
        out_at: Any,
        out_stride: Any,
        pairs: Any,
    ) -> tuple[Any, Callable[..., Any]]:
        return typer(typingctx, x, x_at, x_stride, blocks, w_at, out, out_at, out_stride, pairs)

    return intrinsic(tile)


@functools.cache
def _bfloat() -> Any:
    """LLVM's bfloat type, which llvmlite lacks and the intrinsic's operands need (one
    instance, so that every microkernel declares the intrinsic with the same type)."""
    from llvmlite import ir

    class BFloat(ir.Type):
        def _to_string(self) -> str:
            return "bfloat"

        def __eq__(self, other: object) -> bool:
            return isinstance(other, BFloat)

        def __hash__(self) -> int:
            return hash("bfloat")

    return BFloat()


_kernel = NumbaKernel("bf16 dot", _build)
