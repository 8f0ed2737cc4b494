"""RMSNorm of fp32 hidden states on a CPU, with the residual add before it, in one numba call.

As torch ops (``layer_ops_reference.rms_norm``) a norm is six elementwise passes and a
reduction (add, square, mean, add eps, rsqrt, two products), each a dispatch and a full
read and write of the hidden states: twice a layer, the largest share of a decode step's
time outside the GEMMs and the attention. Here each row is read once, summed and scaled,
the rows spread over torch's threads (``numba_runtime.py``).

Every operation rounds as the torch ops round it except the sum of squares, which is
taken in a fixed order of its own: sixteen running sums over the row's columns in steps
of sixteen, then the leftover columns, then the sixteen sums in order. No fast-math: no
contraction into FMAs and no reassociation, so the bits are the same on every CPU (AVX2
and AVX-512 vectorize the same lanes) and at every batch size: a row is computed alone.
So a model's hidden-state norms take this path for every row or none (2-D contiguous
float32 inputs; a per-head norm's strided views keep the torch ops), never by batch size.
"""

from __future__ import annotations

from typing import Any, overload

import numpy as np
import torch

from cadence.kernels.cpu.numba_runtime import NumbaKernel

LANES = 16  # running sums of squares per row (one AVX-512 vector, two AVX2 vectors)


def applies(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether ``rms_norm`` serves these tensors (a fact of the call site, not the batch)."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    plain = all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in tensors)
    shapes = x.dim() == 2 and weight.shape == x.shape[1:] and (residual is None or residual.shape == x.shape)
    return plain and shapes and _kernel.function() is not None


@overload
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``reference.rms_norm`` for inputs ``applies`` accepts: ``weight * rmsnorm(x)``, or
    with ``residual`` ``(weight * rmsnorm(x + residual), x + residual)``."""
    x = x.detach()
    out = torch.empty_like(x)
    summed = torch.empty_like(x) if residual is not None else x
    source = residual if residual is not None else torch.zeros(0, x.shape[1], dtype=torch.float32)
    _kernel(
        x.numpy(),
        source.detach().numpy(),
        weight.detach().numpy(),
        np.float32(eps),
        out.numpy(),
        summed.numpy(),
    )
    return out if residual is None else (out, summed)


def _build(parallel: bool, cache: bool) -> Any:
    from numba import njit, prange
    from numba import types as nt

    matrix = nt.float32[:, ::1]
    signature = nt.void(matrix, matrix, nt.float32[::1], nt.float32, matrix, matrix)

    @njit(signature, parallel=parallel, nogil=True, error_model="numpy", cache=cache)
    def norm_rows(x: Any, residual: Any, weight: Any, eps: Any, out: Any, summed: Any) -> None:  # pragma: no cover
        cols = x.shape[1]
        add = residual.shape[0] > 0
        whole = cols - cols % LANES
        partial = np.zeros((x.shape[0], LANES), np.float32)  # one allocation, not one a row
        for r in prange(x.shape[0]):
            row, dst = x[r], out[r]
            if add:
                total = summed[r]
                extra = residual[r]
                for c in range(cols):
                    total[c] = row[c] + extra[c]
                row = total
            sums = partial[r]
            for start in range(0, whole, LANES):
                block = row[start : start + LANES]
                for lane in range(LANES):
                    sums[lane] += block[lane] * block[lane]
            for c in range(whole, cols):
                sums[c - whole] += row[c] * row[c]
            square_sum = np.float32(0.0)
            for lane in range(LANES):
                square_sum += sums[lane]
            scale = np.float32(1.0) / np.sqrt(square_sum / np.float32(cols) + eps)
            for c in range(cols):
                dst[c] = weight[c] * (row[c] * scale)

    x = np.full((1, 3), 2.0, np.float32)
    out, summed = np.empty_like(x), np.empty_like(x)
    norm_rows(x, np.ones_like(x), np.ones(3, np.float32), np.float32(0.0), out, summed)
    if not (np.array_equal(summed, x + 1) and np.allclose(out, 1.0)):
        raise RuntimeError(f"the CPU RMSNorm kernel computed a wrong value: {out}, {summed}")
    return norm_rows


_kernel = NumbaKernel("CPU RMSNorm", _build)
