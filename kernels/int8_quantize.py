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

from typing import Any

import numpy as np
import torch

from cadence.kernels.numba_runtime import NumbaKernel

BLOCK = 32  # K per block: one scale per row and level
LEVELS = (1, 2)
QMAX = 127.0  # codes in [-127, 127]: the GEMM's pair sums stay within int16


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


def _build_quantize(parallel: bool, cache: bool) -> Any:
    from numba import njit, prange
    from numba import types as nt

    signature = nt.void(nt.float32[:, ::1], nt.int8[:, ::1], nt.float32[:, :, ::1])
    zero, top, nan = np.float32(0.0), np.float32(QMAX), np.float32(np.nan)
    # Below this a block's 127 / peak overflows fp32: such a block (all values under 4e-37)
    # quantizes to zeros.
    tiny = np.float32(QMAX / np.finfo(np.float32).max)

    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def quantize_rows(x: Any, qa: Any, fields: Any) -> None:  # pragma: no cover - compiled by numba
        k, levels = x.shape[1], fields.shape[2] - 1
        for row in prange(x.shape[0]):
            for b in range(fields.shape[1]):
                start = b * BLOCK
                total = zero
                for level in range(levels):
                    # What is left to quantize: the value, or the first level's remainder.
                    peak, finite = zero, True
                    for j in range(start, start + BLOCK):
                        left = x[row, j] if level == 0 else x[row, j] - fields[row, b, 0] * np.float32(qa[row, j])
                        peak = max(peak, abs(left))
                        finite = finite and np.isfinite(left)
                    if not finite:  # NaN or inf in the block: its outputs are NaN, as a float GEMM's would be
                        peak = nan
                    inverse = top / peak if peak > tiny else zero
                    codes = 0
                    for j in range(start, start + BLOCK):
                        left = x[row, j] if level == 0 else x[row, j] - fields[row, b, 0] * np.float32(qa[row, j])
                        code = np.int8(np.rint(left * inverse))
                        qa[row, level * k + j] = code
                        codes += np.int32(code)
                    scale = zero if peak <= tiny else peak / top  # NaN stays NaN
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


_quantize = NumbaKernel("int8 activation quantizer", _build_quantize)
