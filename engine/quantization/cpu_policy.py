"""Which torch path a quantized linear layer takes on CPU, from the CPU's ISA and the batch.

The thresholds come from measurements on an AMX CPU (bench/RESULTS.md, "CPU linear paths
by batch size"; bench/quant.py's crossover table):

* ``_weight_int8pack_mm`` and ``_weight_int4pack_mm_for_cpu`` with bf16 activations beat
  every dense path at M = 1 (memory-bound: they read 1/4 resp. 1/8 of the fp32 bytes),
  but lose to dense bf16 (AMX) by several times at large M.
* ``_weight_int8pack_mm`` with fp32 activations is far slower than fp32 dense at every
  M, so activations are always cast to bf16 for it (and the output cast back).
* int8: dequantizing the weight per call (int8 -> bf16 times the scale; the dense copy
  lives only for that call, so the memory saving stands) and running the dense bf16
  matmul costs about the same at any M, while the packed op grows with M; they cross
  between M = 16 and M = 32 on SmolLM2's shapes, hence ``int8_packed_max_m = 16``.
* int4: likewise, dequantizing the packed bytes per call (``cpu_int4_layout``, fp32
  arithmetic) and running the bf16 matmul is flat in M; the packed op crosses it
  between M = 64 and 96, hence ``int4_packed_max_m = 64``. Prefill stays slower than
  dense bf16 by the dequantize pass, the price of the memory.

Without AVX512-BF16/AMX, bf16 matmuls are slow, so the per-call dequantized path runs in
the activation dtype instead, and the packed op is kept for longer (M <= 32); that
branch has not been measured on such a machine.

fp8 (``Fp8Method``) decodes its codes to fp16 and runs the fp16 matmul where oneDNN has
fast fp16 (AVX512-FP16 / AMX-FP16), else widens them to fp32 (exact; that branch is not
measured either). Why in ``fp8_linear.py``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class CpuQuantPolicy:
    """The CPU dispatch decisions for quantized linears."""

    fast_bf16: bool  # AVX512-BF16 or AMX: bf16 matmuls are faster than fp32
    int8_packed_max_m: int  # int8: rows <= this take _weight_int8pack_mm, more dequantize
    fast_fp16: bool = False  # oneDNN runs fp16 matmuls natively (AVX512-FP16 or AMX-FP16)
    # int4: rows <= this take _weight_int4pack_mm_for_cpu, more dequantize to bf16 (which
    # needs fast bf16: without it the packed op serves every M).
    int4_packed_max_m: int = 1 << 30

    def dense_dtype(self, activation_dtype: torch.dtype) -> torch.dtype:
        """The dtype of the per-call dequantized matmul for int8 at large M."""
        return torch.bfloat16 if self.fast_bf16 else activation_dtype

    def fp8_matmul_dtype(self) -> torch.dtype:
        """The dtype fp8 codes are decoded to for the CPU matmul (both hold them exactly)."""
        return torch.float16 if self.fast_fp16 else torch.float32


def has_fast_bf16() -> bool:
    """Whether this CPU has AMX or AVX512-BF16, which make bf16 matmuls faster than fp32."""
    # Private helpers, but the same ones torch's own CPU dispatch consults; a torch
    # without them is treated as "no fast bf16", the conservative answer.
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    for probe in probes:
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and bool(fn()):
            return True
    return False


def has_fast_fp16() -> bool:
    """Whether oneDNN runs fp16 matmuls natively on this CPU (private probe; False without it)."""
    probe = getattr(torch.ops.mkldnn, "_is_mkldnn_fp16_supported", None)
    return probe is not None and bool(probe())


@functools.lru_cache(maxsize=1)
def cpu_policy() -> CpuQuantPolicy:
    """The policy for this process's CPU (computed once)."""
    # See the module docstring for where 16 and 64 come from; without bf16 hardware the dense
    # matmul is fp32 (several times slower at M >= 16), so the packed op stays ahead for longer.
    fast = has_fast_bf16()
    return CpuQuantPolicy(
        fast_bf16=fast,
        int8_packed_max_m=16 if fast else 32,
        fast_fp16=has_fast_fp16(),
        int4_packed_max_m=64 if fast else 1 << 30,
    )
