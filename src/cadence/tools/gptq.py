"""GPTQ: int4 weights chosen against calibration activations, not just rounded.

Round-to-nearest minimises each weight's own error; GPTQ (Frantar et al., 2022) minimises
the layer's output error ``||X W^T - X Q^T||`` over calibration inputs ``X``. It quantizes
the columns of ``W`` (input features) one at a time and spreads each column's rounding
error over the columns not yet quantized, weighted by the inverse Hessian ``H = 2 X^T X``
of that least-squares problem. Groups take their scale (and zero) from the weights as
they stand when the group's first column is reached, so earlier error feedback counts.

Columns are processed in their natural order (no act-order), so the result is a plain
group-wise ``Int4Weight`` that every int4 path here, and any GPTQ loader, reads.
"""

from __future__ import annotations

import torch

from cadence.kernels.formats.quant_formats import SYMMETRIC_ZERO, Int4Weight, pack_nibbles

# Hessian dampening, as a fraction of its mean diagonal (the paper's and AutoGPTQ's 1%).
DEFAULT_DAMPING = 0.01
# Columns updated together before the trailing matrix is touched (a speed knob only).
BLOCK_COLUMNS = 128


class HessianAccumulator:
    """``H = 2 / n * sum(x x^T)`` over every calibration row a layer sees, in float64."""

    def __init__(self, in_features: int, device: torch.device | str = "cpu") -> None:
        self.hessian = torch.zeros(in_features, in_features, dtype=torch.float64, device=device)
        self.rows = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).to(torch.float64)
        n = x.shape[0]
        # Running mean, so the scale does not depend on how the rows were batched.
        self.hessian *= self.rows / (self.rows + n)
        self.rows += n
        self.hessian += (2.0 / self.rows) * (x.t() @ x)


def _group_grid(w: torch.Tensor, symmetric: bool, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) per output row for the columns ``w [N, g]``, as quantize_int4 picks
    them, with the scale already rounded to ``scale_dtype`` (what the checkpoint stores)."""
    if symmetric:
        scale = w.abs().amax(dim=1) / 7.0
        zero = torch.full_like(scale, float(SYMMETRIC_ZERO))
    else:
        lo = w.amin(dim=1).clamp(max=0.0)
        hi = w.amax(dim=1).clamp(min=0.0)
        scale = (hi - lo) / 15.0
        zero = torch.round(-lo / scale.clamp(min=1e-30)).clamp(0, 15)
        # GPTQ's v1 format stores zero - 1 in four bits, so a zero of 0 is written as 15,
        # which vLLM's and AutoGPTQ's kernels read as 16. A group with nothing below zero
        # therefore takes zero 1 and a scale that still reaches its maximum with code 15.
        lowest = zero == 0
        scale = torch.where(lowest, hi / 14.0, scale)
        zero = torch.where(lowest, torch.ones_like(zero), zero)
    scale = scale.to(scale_dtype).to(torch.float64)
    # An all-zero group (or one below the scale dtype's range) has scale 0: any scale
    # codes it exactly as its zero point, and 1 avoids dividing by zero.
    return torch.where(scale == 0, torch.ones_like(scale), scale), zero


def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    group_size: int,
    symmetric: bool = True,
    damping: float = DEFAULT_DAMPING,
    scale_dtype: torch.dtype = torch.float16,
) -> Int4Weight:
    """``weight [N, K]`` to an ``Int4Weight`` (groups of ``group_size`` along K) by GPTQ."""
    n, k = weight.shape
    if k % group_size or group_size % 8:
        raise ValueError(f"K={k} must be a multiple of group_size={group_size}, itself a multiple of 8")
    w = weight.detach().to(torch.float64).clone()
    h = hessian.to(torch.float64).clone()
    dead = torch.diagonal(h) == 0  # inputs never active: their weights cannot matter
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    h += damping * torch.diagonal(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    # The upper Cholesky factor of H^-1 gives, row by row, each column's error weights.
    h_inv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)

    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    scales = torch.empty(k // group_size, n, dtype=torch.float64, device=w.device)
    zeros = torch.empty(k // group_size, n, dtype=torch.float64, device=w.device)
    block = max(group_size, BLOCK_COLUMNS // group_size * group_size)  # whole groups per block
    for start in range(0, k, block):
        end = min(start + block, k)
        w_block, h_block = w[:, start:end], h_inv[start:end, start:end]
        errors = torch.zeros_like(w_block)
        for j in range(end - start):
            column = start + j
            if column % group_size == 0:
                g = column // group_size
                scales[g], zeros[g] = _group_grid(w_block[:, j : j + group_size], symmetric, scale_dtype)
            g = column // group_size
            code = torch.round(w_block[:, j] / scales[g] + zeros[g]).clamp(0, 15)
            codes[:, column] = code.to(torch.uint8)
            error = (w_block[:, j] - (code - zeros[g]) * scales[g]) / h_block[j, j]
            w_block[:, j:] -= error[:, None] * h_block[j, j:][None, :]
            errors[:, j] = error
        w[:, end:] -= errors @ h_inv[start:end, end:]
    packed = pack_nibbles(codes.t().contiguous(), dim=0)
    zero_points = None if symmetric else zeros.to(torch.uint8).contiguous()
    return Int4Weight(packed, scales.to(scale_dtype).contiguous(), zero_points, group_size)
