"""Plain-torch definitions of the decoder's small ops, which rms_norm.py, rotary.py and
silu_and_mul.py implement as Triton kernels.

They live apart from the kernels because they are also the CPU path, and a CPU install
has no triton to import. Their rounding is transformers': every elementwise op rounds to
the activation dtype, reductions run in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


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
    c = cos[positions].unsqueeze(1).to(q.dtype)
    s = sin[positions].unsqueeze(1).to(q.dtype)
    return _rotate(q, c, s), _rotate(k, c, s)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # Equal to HF's x * cat(cos, cos) + rotate_half(x) * cat(sin, sin), without building
    # the concatenated tables or the rotated copy.
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2 * I]`` (gate then up) -> ``silu(gate) * up`` ``[..., I]``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
