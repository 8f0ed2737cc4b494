"""SwiGLU's activation: ``silu(gate) * up`` from the fused gate/up projection, in one kernel.

torch runs it as a silu, a multiply and (for the split halves) strided reads: two launches
and an intermediate tensor per layer. Rounding follows torch: silu is computed in float32
and rounded to the activation dtype before the multiply, which rounds again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.layer_ops_reference import silu_and_mul as reference


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """What ``reference`` computes, as one launch; ``out`` ([rows, I], contiguous) lets
    tests poison the output."""
    inter = gate_up.shape[-1] // 2
    rows = gate_up.reshape(-1, 2 * inter)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if out is None:
        out = torch.empty((rows.shape[0], inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows.shape[0]:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(inter, block))](
            rows,
            out,
            inter,
            rows.stride(0),
            out.stride(0),
            BLOCK=block,
            num_warps=4,
        )
    return out.view(*gate_up.shape[:-1], inter)


__all__ = ["reference", "silu_and_mul"]
