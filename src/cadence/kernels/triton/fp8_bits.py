"""Reading e4m3 (float8_e4m3fn) codes as plain bytes inside Triton kernels.

Triton accepts its e4m3 type only on GPUs with fp8 hardware (compute capability 8.9+):
on an A100 even a load of an fp8 pointer fails to compile (tests/test_kernels_compile.py
found it). Kernels that must run everywhere take fp8 tensors viewed as uint8 and decode
the bits themselves: the code's sign and its 7 exponent+mantissa bits, moved into an fp16
bit pattern, are exactly the value divided by ``FP16_DECODE_DIVISOR`` (e4m3's exponent
bias is 7, fp16's 15), subnormals included. Callers fold the divisor into a scale.
"""

from __future__ import annotations

import triton
import triton.language as tl

from cadence.kernels.formats.fp8_format import FP16_DECODE_DIVISOR

__all__ = ["FP16_DECODE_DIVISOR", "e4m3_bits_to_fp16"]


@triton.jit
def e4m3_bits_to_fp16(bits):
    """uint8 e4m3 codes -> fp16 values FP16_DECODE_DIVISOR times smaller (exact)."""
    b = bits.to(tl.uint16)
    half_bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
    return half_bits.to(tl.float16, bitcast=True)
