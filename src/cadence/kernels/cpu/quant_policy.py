"""Whether oneDNN runs fp16 matmuls natively on the CPU the process runs on, which decides
the dtype fp8 codes are decoded to: fp16 where it does (AVX512-FP16 / AMX-FP16), else
fp32, which holds them exactly (``engine/quantization/fp8_linear.py``).

Which kernel a quantized linear layer runs is not decided here but by rule in
``engine/quantization/cpu_planner.py``, and the precision a model runs in by
``engine/precision.py`` (``bf16dot`` where it runs; else ``half_linear.native_bf16``, the
oneDNN bf16 instructions, decides whether a half-precision checkpoint computes in bf16).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuQuantPolicy:
    """The ISA facts the CPU paths depend on."""

    fast_fp16: bool = False  # oneDNN runs fp16 matmuls natively (AVX512-FP16 or AMX-FP16)

    def fp8_matmul_dtype(self) -> torch.dtype:
        """The dtype fp8 codes are decoded to for the CPU matmul (both hold them exactly)."""
        return torch.float16 if self.fast_fp16 else torch.float32


def has_fast_fp16() -> bool:
    """Whether oneDNN runs fp16 matmuls natively on the running CPU (private probe; False without it)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    return probe is not None and bool(probe())


@functools.lru_cache(maxsize=1)
def cpu_policy() -> CpuQuantPolicy:
    """The policy for this process's CPU (computed once)."""
    return CpuQuantPolicy(fast_fp16=has_fast_fp16())
