"""Plain-torch definitions of the decoder's small ops, which rms_norm.py, rotary.py and
silu_and_mul.py implement as Triton kernels.

They live apart from the kernels because they are also the CPU path, and a CPU install
has no triton to import. Their rounding is transformers': every elementwise op rounds to
the activation dtype, reductions run in float32.
"""

from __future__ import annotations

from typing import overload

import torch
import torch.nn.functional as F


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
    """``weight * rmsnorm(x)``; with ``residual``, normalize ``x + residual`` and return
    ``(normed, x + residual)``, the sum being the next residual."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return normed if residual is None else (normed, x)


def rotary(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated copies of ``q [T, H, D]`` and ``k [T, KV, D]`` (Hugging Face's layout: dim i
    pairs with i + D/2); ``cos``/``sin`` are float32 tables ``[max_positions, D / 2]``."""
    cos_rows, sin_rows = rotary_rows(positions, cos, sin, q.dtype)
    return rotate(q, cos_rows, sin_rows), rotate(k, cos_rows, sin_rows)


def rotary_rows(
    positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``[T, 1, D]`` factors `rotate` takes for these positions: ``cat(cos, cos)`` and
    ``cat(-sin, sin)`` of each position's row, cast to the activation dtype. They depend
    on the positions alone, so a forward pass computes them once for all its layers."""
    c = cos.index_select(0, positions).unsqueeze(1).to(dtype)
    s = sin.index_select(0, positions).unsqueeze(1).to(dtype)
    return torch.cat((c, c), dim=-1), torch.cat((-s, s), dim=-1)


def rotate(x: torch.Tensor, cos_rows: torch.Tensor, sin_rows: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, D]`` rotated: ``(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` with each
    product and sum rounded to the dtype, as HF's ``x * cos + rotate_half(x) * sin``.

    Rolling x by D/2 gives ``(x2, x1)``; with the sign in ``sin_rows`` the first half is
    ``x1 * cos + x2 * -sin``, bit-equal to ``x1 * cos - x2 * sin`` since negation is
    exact. That is four ops per tensor instead of nine (two slices, four multiplies, an
    add, a subtract and a concatenation)."""
    return x * cos_rows + x.roll(x.shape[-1] // 2, dims=-1) * sin_rows


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * I]`` (gate then up) -> ``silu(gate) * up`` ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
