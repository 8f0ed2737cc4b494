"""Rotary embedding of fp32 q and k on a CPU in one numba call per layer.

As torch ops (``layer_ops_reference.rotate``) a layer's rotation of q and k is eight
elementwise passes (a roll, two products and a sum each), every one a dispatch and a
full read and write of its tensor. Here q and k are read once, straight from the
projection's rows they are views of, their rows spread over torch's threads
(``numba_runtime.py``). Each product and sum is rounded once, as the torch ops round
them, so the bits are the reference's, whichever path a step takes: below
``MIN_ROWS`` tokens the torch ops are quicker than a numba call's overhead.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from cadence.kernels.numba_runtime import NumbaKernel

MIN_ROWS = 8  # tokens from which one numba call beats the torch ops


def rotary_factors(cos_rows: torch.Tensor, sin_rows: torch.Tensor) -> torch.Tensor:
    """``reference.rotary_rows``' ``[T, 1, D]`` factors as the ``[T, 2D]`` table ``rotate``
    reads (cos then sin): made once per forward pass, for every layer."""
    t = cos_rows.shape[0]
    return torch.cat((cos_rows.reshape(t, -1), sin_rows.reshape(t, -1)), dim=1).contiguous()


def rotate(q: torch.Tensor, k: torch.Tensor, factors: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``reference.rotate`` of ``q [T, H, D]`` and ``k [T, KV, D]`` by ``rotary_factors``, in
    one call; None where this path does not apply. q and k are views into one
    projection's rows (each head's values contiguous), as the attention's split makes them."""
    if q.shape[0] < MIN_ROWS or not (_fp32_cpu(q) and _fp32_cpu(k) and _fp32_cpu(factors)):
        return None
    t, d, stride = q.shape[0], q.shape[2], q.stride(0)
    k_at = k.storage_offset() - q.storage_offset()
    same_rows = q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() and k.stride(0) == stride
    if not same_rows or k_at < 0 or q.stride()[1:] != (d, 1) or k.stride()[1:] != (d, 1) or factors.shape[1] != 2 * d:
        return None
    if _rotate.function() is None:
        return None
    q_out = torch.empty(q.shape, dtype=torch.float32)
    k_out = torch.empty(k.shape, dtype=torch.float32)
    # The rows as one flat array from q's first value: the kernel indexes it by row stride
    # and offset, so its inner loops run over contiguous values.
    span = (t - 1) * stride + max(q.shape[1] * d, k_at + k.shape[1] * d)
    flat = torch.as_strided(q, (span,), (1,), q.storage_offset())
    _rotate(flat.numpy(), stride, k_at, factors.numpy(), q_out.view(t, -1).numpy(), k_out.view(t, -1).numpy())
    return q_out, k_out


def _fp32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.is_cpu


def _build_rotate(parallel: bool, cache: bool) -> Any:
    from numba import njit, prange
    from numba import types as nt

    matrix = nt.float32[:, ::1]
    signature = nt.void(nt.float32[::1], nt.int64, nt.int64, matrix, matrix, matrix)

    # No fastmath: each product and sum rounds once, as the torch ops do.
    @njit(signature, parallel=parallel, nogil=True, cache=cache)
    def rotate_rows(
        flat: Any, stride: Any, k_at: Any, factors: Any, q_out: Any, k_out: Any
    ) -> None:  # pragma: no cover - numba
        d = factors.shape[1] // 2
        half = d // 2
        for t in prange(q_out.shape[0]):
            cos, sin = factors[t, :d], factors[t, d:]
            for which in range(2):
                out = q_out[t] if which == 0 else k_out[t]
                base = t * stride + (0 if which == 0 else k_at)
                for h in range(out.shape[0] // d):
                    # Slices indexed by the loop variable alone: no wraparound checks, so
                    # LLVM vectorizes. Rolling by half pairs value j with j + half and back.
                    x = flat[base + h * d : base + (h + 1) * d]
                    low, high = x[:half], x[half:]
                    y = out[h * d : (h + 1) * d]
                    y_low, y_high = y[:half], y[half:]
                    for j in range(half):
                        y_low[j] = low[j] * cos[j] + high[j] * sin[j]
                    for j in range(half):
                        y_high[j] = high[j] * cos[half + j] + low[j] * sin[half + j]

    flat = np.arange(8, dtype=np.float32)
    q_out, k_out = np.empty((1, 4), np.float32), np.empty((1, 4), np.float32)
    factors = np.array([[1, 1, 1, 1, 0, 0, 0, 0]], np.float32)
    rotate_rows(flat, 8, 4, factors, q_out, k_out)
    if not (np.array_equal(q_out[0], flat[:4]) and np.array_equal(k_out[0], flat[4:])):
        raise RuntimeError(f"the CPU rotary kernel computed a wrong value: {q_out}, {k_out}")
    return rotate_rows


_rotate = NumbaKernel("CPU rotary embedding", _build_rotate)
