"""The register tile of ``int8_dot.py``'s GEMM, as LLVM IR built through numba.

One intrinsic per row count: ``rows`` rows of quantized activations by one block of 16
output columns, over the whole K, the 2 x ``rows`` fp32 accumulators (8 lanes each) kept
in registers across K's blocks of 32. Per K block and activation level, each row's
integer sums are exact: ``vpmaddubsw`` multiplies the weight's unsigned 4-bit codes by
the row's signed int8 values in pairs to int16 (four K offsets per output lane, two
32-byte code rows per step: low nibbles and high nibbles), eight such products summed in
int16 (at most 8 x 2 x 15 x 127 = 30,480: no overflow), then ``vpmaddwd`` by ones to
int32. The fp32 steps that follow, per output, in this order:

    acc = fma(float(sum_l) * s, d_l, acc)    for each level l
    acc = fma(o, total, acc)

where ``s`` and ``o`` are the block's weight scale and offset, ``d_l`` the row's scale of
level ``l`` and ``total`` its quantized activations' sum. The same instructions run for
every row whatever the tile, so a row's bits do not depend on its batch. ``levels`` (1 or
2) is an argument: the intrinsic holds one loop for each and branches once per call.
"""

from __future__ import annotations

from typing import Any

BLOCK = 32  # K per block: one scale for each row's activations, one scale and offset per weight column
BLOCK_COLUMNS = 16  # output columns per packed block: two 8-lane vectors
VECTORS = BLOCK_COLUMNS // 8
STEPS = 4  # 32-byte code rows per vector and K block: 8 K each, low nibbles then high
BLOCK_BYTES = VECTORS * STEPS * 32  # code bytes of one column block's K block
WORDS_PER_BLOCK = BLOCK // 4  # int32 words of one row's int8 activations per K block


def microkernel(rows: int) -> Any:
    """An intrinsic ``tile(qa, qa_at, qa_stride, fields, f_at, kb, levels, codes, scales,
    block, out, out_at, out_stride)``: ``out[r, 0:16]`` for ``rows`` rows (element offsets
    and row strides of each array, ``kb`` blocks of K, ``block`` the column block)."""
    from llvmlite import ir  # type: ignore[import-untyped]
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
            """The loop over K blocks for ``count`` levels, then its stores; on to ``end``."""
            width = count + 1  # fields per row and K block: each level's scale, then the total
            field_rows = [
                builder.gep(data(3, fields), [builder.mul(builder.add(f_at, builder.mul(kb, const(r))), const(width))])
                for r in range(rows)
            ]
            loop, done = builder.append_basic_block(f"kblocks{count}"), builder.append_basic_block(f"store{count}")
            entry = builder.block
            builder.cbranch(builder.icmp_signed(">", kb, const(0)), loop, done)

            builder.position_at_end(loop)
            b = builder.phi(i64)
            b.add_incoming(const(0), entry)
            acc = [builder.phi(lanes) for _ in range(rows * VECTORS)]
            for a in acc:
                a.add_incoming(zero, entry)
            sums: dict[tuple[int, int, int], Any] = {}  # (level, row, vector) -> int16 sums
            code_block = builder.gep(code_base, [builder.mul(b, const(BLOCK_BYTES))])
            block_word = builder.mul(b, const(WORDS_PER_BLOCK))
            for step in range(STEPS):
                nibbles = []
                for v in range(VECTORS):
                    at = builder.gep(code_block, [const((v * STEPS + step) * 32)])
                    raw = builder.load(builder.bitcast(at, bytes32.as_pointer()), align=1)
                    shifted = builder.bitcast(builder.lshr(builder.bitcast(raw, shorts), four), bytes32)
                    nibbles.append((builder.and_(raw, low_mask), builder.and_(shifted, low_mask)))
                for r in range(rows):
                    for level in range(count):
                        word = builder.add(builder.mul(level_words, const(level)), block_word)
                        for half in range(2):
                            at = builder.add(word, const(2 * step + half))
                            four_bytes = builder.load(builder.gep(qa_rows[r], [at]), align=4)
                            spread = builder.bitcast(splat(four_bytes, words, 8), bytes32)
                            for v in range(VECTORS):
                                product = builder.call(maddubs, [nibbles[v][half], spread])
                                key = (level, r, v)
                                sums[key] = builder.add(sums[key], product) if key in sums else product
            field_block = builder.gep(scale_base, [builder.mul(b, const(2 * BLOCK_COLUMNS))])
            weight = [
                builder.load(builder.bitcast(builder.gep(field_block, [const(at)]), lanes.as_pointer()), align=4)
                for at in range(0, 2 * BLOCK_COLUMNS, 8)
            ]
            w_scale, w_offset = weight[:VECTORS], weight[VECTORS:]
            summed = []
            for r in range(rows):
                row_fields = builder.gep(field_rows[r], [builder.mul(b, const(width))])
                row = [
                    splat(builder.load(builder.gep(row_fields, [const(f)]), align=4), lanes, 8) for f in range(width)
                ]
                for v in range(VECTORS):
                    value = acc[r * VECTORS + v]
                    for level in range(count):
                        exact = builder.sitofp(builder.call(maddwd, [sums[(level, r, v)], ones]), lanes)
                        value = builder.call(fma, [builder.fmul(exact, w_scale[v]), row[level], value])
                    summed.append(builder.call(fma, [w_offset[v], row[count], value]))
            following = builder.add(b, const(1))
            tail = builder.block
            b.add_incoming(following, tail)
            for a, s in zip(acc, summed):
                a.add_incoming(s, tail)
            builder.cbranch(builder.icmp_signed("<", following, kb), loop, done)

            builder.position_at_end(done)
            results = []
            for s in summed:  # PHIs first in the block, then the stores
                result = builder.phi(lanes)
                result.add_incoming(zero, entry)
                result.add_incoming(s, tail)
                results.append(result)
            for r in range(rows):
                for v in range(VECTORS):
                    target = builder.bitcast(builder.gep(out_rows[r], [const(8 * v)]), lanes.as_pointer())
                    builder.store(results[r * VECTORS + v], target, align=4)
            builder.branch(end)

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
    def tile(typingctx, qa, qa_at, qa_stride, fields, f_at, kb, levels, codes, scales, block, out, out_at, out_stride):
        args = (qa, qa_at, qa_stride, fields, f_at, kb, levels, codes, scales, block, out, out_at, out_stride)
        return nt.void(*args), codegen

    return intrinsic(tile)
