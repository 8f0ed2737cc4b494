"""The W4A16 GEMV's inline PTX, executed on CPU by tests/support/ptx_emulator.py.

On a GPU with fp16 activations the GEMV unpacks nibbles and multiplies them in inline
PTX, which the interpreter cannot run: the other CPU tests exercise its plain-Triton twin.
Here the asm text itself runs through a model of each instruction and is compared with
float64 sums. Tolerance: relative 2e-3, for fp16 accumulation of four products per half.
"""

from __future__ import annotations

import numpy as np

from cadence.kernels.triton import w4a16_gemv
from tests.support.helpers import rel_err
from tests.support.ptx_emulator import inline_asm_texts, run_ptx

DOT8_TOL = 2e-3


def dot8_asm() -> str:
    (asm,) = inline_asm_texts(w4a16_gemv._dot8_fp16)
    return asm


def pack_words(codes: np.ndarray) -> np.ndarray:
    """codes uint [..., 8] (nibble s at bits 4s) -> uint32 words [...]."""
    return sum(codes[..., s].astype(np.uint32) << np.uint32(4 * s) for s in range(8))


def fp16_pairs(x: np.ndarray) -> list[np.ndarray]:
    """x [..., 8] -> the four fp16x2 operands: pair p holds (x of nibble p, x of nibble p + 4)."""
    bits = x.astype(np.float16).view(np.uint16).astype(np.uint32)
    return [bits[..., p] | (bits[..., p + 4] << np.uint32(16)) for p in range(4)]


def dot8(codes: np.ndarray, x: np.ndarray) -> np.ndarray:
    out = run_ptx(dot8_asm(), [pack_words(codes), *fp16_pairs(x)])
    return out.view(np.float32).astype(np.float64)


def reference(codes: np.ndarray, x: np.ndarray) -> np.ndarray:
    return ((codes.astype(np.float64) - 8) * x.astype(np.float16).astype(np.float64)).sum(-1)


def test_every_code_in_every_nibble_decodes_exactly() -> None:
    # x = 1 in one nibble at a time: the result is exactly code - 8.
    codes = np.repeat(np.arange(16)[:, None], 8, axis=1)  # [16, 8]: every nibble holds the code
    for nibble in range(8):
        x = np.zeros((16, 8))
        x[:, nibble] = 1.0
        assert np.array_equal(dot8(codes, x), np.arange(16) - 8.0), nibble


def test_random_words_and_activations_match_float64() -> None:
    rng = np.random.default_rng(0)
    codes = rng.integers(0, 16, size=(4096, 8))
    for scale in (1e-2, 1.0, 100.0):
        x = rng.standard_normal((4096, 8)) * scale
        assert rel_err(dot8(codes, x), reference(codes, x)) < DOT8_TOL, scale


def test_large_activations_do_not_overflow_fp16() -> None:
    # Four same-sign terms of 8 * 30,000 per half would be 960,000 in fp16 (max 65,504):
    # the 1/16 recentring keeps the accumulator at 60,000.
    codes = np.array([[0] * 8, [15] * 8, [0, 15, 0, 15, 0, 15, 0, 15]])
    x = np.array([[30000.0] * 8, [-30000.0] * 8, [30000.0, -30000.0] * 4])
    got = dot8(codes, x)
    assert np.isfinite(got).all()
    assert rel_err(got, reference(codes, x)) < DOT8_TOL


def test_pair_permutes_the_halves_of_two_words() -> None:
    high, low = inline_asm_texts(w4a16_gemv._pair)  # source order: the HIGH branch first
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**32, size=256, dtype=np.uint64).astype(np.uint32)
    b = rng.integers(0, 2**32, size=256, dtype=np.uint64).astype(np.uint32)
    mask = np.uint32(0xFFFF)
    assert np.array_equal(run_ptx(high, [a, b]), (a >> np.uint32(16)) | ((b >> np.uint32(16)) << np.uint32(16)))
    assert np.array_equal(run_ptx(low, [a, b]), (a & mask) | ((b & mask) << np.uint32(16)))
