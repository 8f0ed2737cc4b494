"""Rotary embedding of fp32 q and k on a CPU in one numba call per layer.

As torch ops (``layer_ops_reference.rotate``) a layer's rotation of q and k is eight
elementwise passes (a roll, two products and a sum each), every one a dispatch and a
full read and write of its tensor. Here q and k are read once, straight from the
projection's rows they are views of (or from their own tensors, after a per-head norm),
their rows spread over torch's threads
(``numba_runtime.py``). Each product and sum is rounded once, as the torch ops round
them, so the bits are the reference's, whichever path a step takes: below
``MIN_ROWS`` tokens the torch ops are quicker than a numba call's overhead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cadence.kernels.cpu.numba_runtime import NumbaKernel

MIN_ROWS = 8  # tokens from which one numba call beats the torch ops


def rotary_factors(cos_rows: torch.Tensor, sin_rows: torch.Tensor) -> torch.Tensor:
    """``reference.rotary_rows``' ``[T, 1, D]`` factors as the ``[T, 2D]`` table ``rotate``
    reads (cos then sin): made once per forward pass, for every layer."""
    t = cos_rows.shape[0]
    return torch.cat((cos_rows.reshape(t, -1), sin_rows.reshape(t, -1)), dim=1).contiguous()


def rotate(q: torch.Tensor, k: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``reference.rotate`` of ``q [T, H, D]`` and ``k [T, KV, D]`` by ``rotary_factors``
    (``[T, 2D]``), in one call; None where this path does not apply (or, under
    ``MIN_ROWS`` tokens, does not pay). Each head's values must be contiguous: views into
    one projection's rows, as the attention's split makes them, or tensors of their own."""
    t, d = q.shape[0], q.shape[-1]
    if t < MIN_ROWS or not (_fp32_cpu(q) and _fp32_cpu(k) and _fp32_cpu(factors)):
        return None
    shapes_fit = q.dim() == k.dim() == 3 and k.shape[0] == t and k.shape[2] == d and factors.shape == (t, 2 * d)
    if not shapes_fit or not factors.is_contiguous() or not (_heads_contiguous(q) and _heads_contiguous(k)):
        return None
    if _rotate.function() is None:
        return None
    q_out = torch.empty(q.shape, dtype=torch.float32)
    k_out = torch.empty(k.shape, dtype=torch.float32)
    _rotate(*_rows(q), *_rows(k), factors.numpy(), q_out.view(t, -1).numpy(), k_out.view(t, -1).numpy())
    return q_out, k_out


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.stride()[1:] == (x.shape[2], 1)


def _rows(x: torch.Tensor) -> tuple[np.ndarray, int]:
    """``x``'s rows as one flat array from its first value, and the row stride: the kernel
    indexes it by both, so its inner loops run over contiguous values (a row of a view
    into a wider projection output need not be contiguous with the next)."""
    stride = x.stride(0)
    span = (x.shape[0] - 1) * stride + x.shape[1] * x.shape[2]
    return torch.as_strided(x.detach(), (span,), (1,), x.storage_offset()).numpy(), stride


def _fp32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu


def _build_rotate(parallel: bool, cache: bool) -> Any:
    from numba import njit, prange
    from numba import types as nt

    matrix = nt.float32[:, ::1]
    signature = nt.void(nt.float32[::1], nt.int64, nt.float32[::1], nt.int64, matrix, matrix, matrix)

    # No fastmath: each product and sum rounds once, as the torch ops do.
    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def rotate_rows(
        q: Any, q_stride: Any, k: Any, k_stride: Any, factors: Any, q_out: Any, k_out: Any
    ) -> None:  # pragma: no cover - numba
        d = factors.shape[1] // 2
        half = d // 2
        for t in prange(q_out.shape[0]):
            cos, sin = factors[t, :d], factors[t, d:]
            for which in range(2):
                source = q if which == 0 else k
                out = q_out[t] if which == 0 else k_out[t]
                base = t * (q_stride if which == 0 else k_stride)
                for h in range(out.shape[0] // d):
                    # Slices indexed by the loop variable alone: no wraparound checks, so
                    # LLVM vectorizes. Rolling by half pairs value j with j + half and back.
                    x = source[base + h * d : base + (h + 1) * d]
                    low, high = x[:half], x[half:]
                    y = out[h * d : (h + 1) * d]
                    y_low, y_high = y[:half], y[half:]
                    for j in range(half):
                        y_low[j] = low[j] * cos[j] + high[j] * sin[j]
                    for j in range(half):
                        y_high[j] = high[j] * cos[half + j] + low[j] * sin[half + j]

    values = np.arange(8, dtype=np.float32)
    q_out, k_out = np.empty((1, 4), np.float32), np.empty((1, 4), np.float32)
    factors = np.array([[1, 1, 1, 1, 0, 0, 0, 0]], np.float32)
    rotate_rows(values[:4], 4, values[4:], 4, factors, q_out, k_out)
    if not (np.array_equal(q_out[0], values[:4]) and np.array_equal(k_out[0], values[4:])):
        raise RuntimeError(f"the CPU rotary kernel computed a wrong value: {q_out}, {k_out}")
    return rotate_rows


_rotate = NumbaKernel("CPU rotary embedding", _build_rotate)
