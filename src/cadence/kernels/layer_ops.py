"""The model's small elementwise ops, each one Triton kernel on a GPU and torch on a CPU.

RMSNorm (with the residual add before it), rotary embedding and SwiGLU's activation are
a few kilobytes of work per token; as torch ops they were ~30 launches per decoder layer,
which dominated a batch-1 decode step's GPU time once CUDA graphs removed the launch cost.
The kernels round as the torch code does where it matters (``layer_ops_reference.py``),
so the two paths agree to a unit in the last place. CPU tensors take the torch code;
triton is only needed where the kernels run, so it is imported on first use. On CPU,
fp32 hidden-state norms run one numba kernel (``kernels/cpu/rms_norm.py``).

Rotary embedding dispatches in ``engine/models/rotary.PositionedRotary`` instead, because its CPU
path prepares the per-token factors once per forward pass, for all layers.
"""

from __future__ import annotations

import torch

from cadence.kernels import layer_ops_reference as reference
from cadence.kernels.cpu import rms_norm as cpu_rms_norm


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``weight * rmsnorm(x)``, or with ``residual`` ``(weight * rmsnorm(x + residual), x + residual)``."""
    if x.is_cuda:
        from cadence.kernels.triton.rms_norm import rms_norm as kernel

        return kernel(x, weight, eps, residual)
    if cpu_rms_norm.applies(x, weight, residual):
        return cpu_rms_norm.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused ``[..., 2 * I]`` projection output."""
    if gate_up.is_cuda:
        from cadence.kernels.triton.silu_and_mul import silu_and_mul as kernel

        return kernel(gate_up)
    return reference.silu_and_mul(gate_up)
