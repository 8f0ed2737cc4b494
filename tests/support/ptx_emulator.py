"""Run our kernels' inline PTX on CPU: a numpy model of the few instructions it uses.

The Triton interpreter cannot execute inline assembly, so the kernels' ASM branches only
ever run on a GPU. This module executes the same asm text, element-wise over numpy
arrays, with each instruction's PTX ISA semantics: integer ops bit for bit, fp16 ops
rounded to nearest even once per instruction (computed in float64, exact for the fp16
products and sums these kernels form), fp32 ops in float32. An instruction it does not
know raises, so a kernel edit that needs a new one cannot pass unnoticed.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable

import numpy as np

_U32 = np.uint32


def inline_asm_texts(jit_function: object) -> list[str]:
    """The asm strings passed to ``tl.inline_asm_elementwise`` in a Triton function's source."""
    python_function = getattr(jit_function, "fn", jit_function)  # a JITFunction keeps the function as .fn
    assert callable(python_function)
    source = inspect.getsource(python_function)
    return [m.group(2) for m in re.finditer(r'inline_asm_elementwise\(\s*("""|")(.*?)\1', source, re.S)]


def _f16(bits: np.ndarray) -> np.ndarray:
    return (bits & 0xFFFF).astype(np.uint16).view(np.float16).astype(np.float64)


def _f16_bits(value: np.ndarray) -> np.ndarray:
    return value.astype(np.float16).view(np.uint16).astype(_U32)


def _f16x2(op: Callable[..., np.ndarray], *operands: np.ndarray) -> np.ndarray:
    """Apply ``op`` to the low and the high fp16 halves; round each result to fp16 once."""
    lo = op(*[_f16(o) for o in operands])
    hi = op(*[_f16(o >> 16) for o in operands])
    return _f16_bits(lo) | (_f16_bits(hi) << 16)


def _f32(bits: np.ndarray) -> np.ndarray:
    return bits.astype(_U32).view(np.float32)


def _lop3(a: np.ndarray, b: np.ndarray, c: np.ndarray, lut: int) -> np.ndarray:
    """Bit i of ``lut`` is the output for inputs (a, b, c) = the bits of i (a the highest)."""
    out = np.zeros_like(a)
    for i in range(8):
        if lut >> i & 1:
            out |= (a if i & 4 else ~a) & (b if i & 2 else ~b) & (c if i & 1 else ~c)
    return out


def _prmt(a: np.ndarray, b: np.ndarray, selector: int) -> np.ndarray:
    """Default-mode byte permute: result byte i is byte (selector nibble i) of {b, a}."""
    both = a.astype(np.uint64) | (b.astype(np.uint64) << np.uint64(32))
    out = np.zeros_like(a)
    for i in range(4):
        nibble = selector >> (4 * i) & 0xF
        byte = (both >> np.uint64(8 * (nibble & 7))) & np.uint64(0xFF)
        if nibble & 8:  # replicate the byte's sign bit
            byte = np.where(byte & np.uint64(0x80), np.uint64(0xFF), np.uint64(0))
        out |= byte.astype(_U32) << _U32(8 * i)
    return out


def run_ptx(asm: str, args: list[np.ndarray]) -> np.ndarray:
    """Execute ``asm`` with ``$1..$n`` bound to ``args`` (uint32 bit patterns); returns ``$0``'s bits."""
    regs: dict[str, np.ndarray] = {f"${i + 1}": np.asarray(a).astype(_U32) for i, a in enumerate(args)}
    shape = np.broadcast(*regs.values()).shape

    def value(token: str) -> np.ndarray:
        token = token.strip()
        if token in regs:
            return regs[token]
        if token.startswith("0f"):  # a float32 immediate, by its bits
            return np.full(shape, int(token[2:], 16), dtype=_U32)
        return np.full(shape, int(token, 0), dtype=_U32)

    body = re.sub(r"//[^\n]*", "", asm)
    for statement in body.split(";"):
        statement = statement.strip().strip("{}").strip()
        if not statement or statement.startswith(".reg"):
            continue
        opcode, _, rest = statement.partition(" ")
        if opcode == "mov.b32" and rest.lstrip().startswith("{"):  # unpack into two b16 registers
            halves, source = rest.split("}", 1)
            lo, hi = (h.strip() for h in halves.strip(" {").split(","))
            bits = value(source.strip(" ,"))
            regs[lo], regs[hi] = bits & 0xFFFF, bits >> 16
            continue
        dest, *ops = (o.strip() for o in rest.split(","))
        if opcode == "mov.b32":
            out = value(ops[0])
        elif opcode == "shr.u32":
            out = value(ops[0]) >> value(ops[1])
        elif opcode == "lop3.b32":
            out = _lop3(value(ops[0]), value(ops[1]), value(ops[2]), int(ops[3], 0))
        elif opcode == "prmt.b32":
            out = _prmt(value(ops[0]), value(ops[1]), int(ops[2], 0))
        elif opcode == "mul.f16x2":
            out = _f16x2(lambda x, y: x * y, value(ops[0]), value(ops[1]))
        elif opcode == "fma.rn.f16x2":
            out = _f16x2(lambda x, y, z: x * y + z, value(ops[0]), value(ops[1]), value(ops[2]))
        elif opcode == "cvt.f32.f16":
            out = _f16(value(ops[0])).astype(np.float32).view(_U32)
        elif opcode == "add.f32":
            out = (_f32(value(ops[0])) + _f32(value(ops[1]))).view(_U32)
        elif opcode == "mul.f32":
            out = (_f32(value(ops[0])) * _f32(value(ops[1]))).view(_U32)
        else:
            raise NotImplementedError(f"no model of PTX {opcode!r}")
        regs[dest] = np.broadcast_to(out, shape).astype(_U32)
    return regs["$0"]
