"""What this CPU's instruction set makes fast: bf16 and fp16 matmuls.

Which kernel a quantized linear layer runs is not decided here but measured on the machine
(``cpu_planner.py``). These probes decide the model's activation dtype on CPU (bf16 where it
is fast, ``loader.resolve_dtype``) and the dtype fp8 codes are decoded to: fp16 where oneDNN
has fast fp16 (AVX512-FP16 / AMX-FP16), else fp32, which holds them exactly
(``fp8_linear.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from cadence.kernels.half_linear import native_bf16


@dataclass(frozen=True)
class CpuQuantPolicy:
    """The ISA facts the CPU paths depend on."""

    fast_bf16: bool  # AVX512-BF16 or AMX: bf16 matmuls are faster than fp32
    fast_fp16: bool = False  # oneDNN runs fp16 matmuls natively (AVX512-FP16 or AMX-FP16)

    def fp8_matmul_dtype(self) -> torch.dtype:
        """The dtype fp8 codes are decoded to for the CPU matmul (both hold them exactly)."""
        return torch.float16 if self.fast_fp16 else torch.float32


def has_fast_bf16() -> bool:
    """Whether this CPU has AMX or AVX512-BF16, which make bf16 matmuls faster than fp32."""
    return native_bf16()


def has_fast_fp16() -> bool:
    """Whether oneDNN runs fp16 matmuls natively on this CPU (private probe; False without it)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    return probe is not None and bool(probe())


@functools.lru_cache(maxsize=1)
def cpu_policy() -> CpuQuantPolicy:
    """The policy for this process's CPU (computed once)."""
    return CpuQuantPolicy(fast_bf16=has_fast_bf16(), fast_fp16=has_fast_fp16())
