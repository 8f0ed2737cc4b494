"""FP8 W8A8 replacement for ``nn.Linear``: e4m3 weights per output channel, e4m3 activations per token.

What vLLM's ``--quantization fp8`` does to a bf16/fp16 checkpoint ("dynamic" FP8): the
weight is quantized once, at load, to float8_e4m3fn with a float32 scale per output
channel; activations are quantized per token on every call (``kernels/fp8_format.py``).
Embeddings and lm_head stay dense (``apply.TARGET_LAYERS``).

Dispatch by device:

* CUDA: ``fp8_matmul`` (``kernels/w8a8_fp8.py``): ``torch._scaled_mm`` on compute
  capability 8.9+, the Triton kernel elsewhere. Imported only when used: a CPU install
  has no triton.
* CPU: the same W8A8 arithmetic in plain torch. Both operands' codes are decoded to
  fp16 (``fp8_as_fp16_divided``: exact, a few integer passes), multiplied by the fp16
  matmul (fp32 accumulation; fp32 on CPUs without fast fp16, see ``cpu_policy``), and
  the two scales applied to the output. The weight is decoded per call and never
  cached, so it stays one byte per weight.

Measured on this project's 2-core AMX Xeon, torch 2.13 (bench/RESULTS.md, "FP8 W8A8
linear on CPU"; ``python bench/fp8_linear.py``), µs per call on SmolLM2's 576 -> 1536
projection, fp32 activations, per-token quantization of x included:

    path                                M=1    M=16   M=64   M=256
    dense bf16 (baseline)                86      79    166     375
    this path                           234     312    469     930
    torch._scaled_mm (oneDNN)         2,817   3,269  3,508   5,610
    fp8 .to(bf16) + bf16 matmul       2,528   2,630  2,903   3,544

``torch._scaled_mm`` does accept CPU fp8 tensors with row-wise scales, but this CPU has
no fp8 arithmetic and torch's fp8 casts are slow (~2.5 ms for this weight against ~0.1
ms for the integer decode), so this path wins at every M and shape measured. It is still
2.5-4.7x dense bf16 (the per-call weight decode is the floor; batch-1 decode on SmolLM2
runs at 0.75-0.79x dense): on CPU fp8 buys memory and the GPU's W8A8 arithmetic, not
speed, and int8 is the faster CPU choice.

Outputs are in the activation dtype; bias is added in it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from cadence.engine.quantization.cpu_policy import cpu_policy
from cadence.engine.quantization.linear import QuantizedLinear
from cadence.kernels.fp8_format import (
    FP16_DECODE_DIVISOR,
    FP8_DTYPE,
    dequantize_fp8,
    fp8_as_fp16_divided,
    quantize_fp8_per_token,
    quantize_fp8_weight,
)

# A decoded code is at most 448 / 256 = 1.75, so a K-long row of products is at most
# 1.75**2 * K: the fp16 output of the CPU matmul holds it for K up to this. Longer rows
# are cut into chunks of it, summed in fp32.
_FP16_SAFE_K = int(torch.finfo(torch.float16).max / (448.0 / FP16_DECODE_DIVISOR) ** 2)


class Fp8Linear(QuantizedLinear):
    """``y = quant(x) @ (qweight * weight_scale[:, None]).T + bias`` with e4m3 ``[N, K]`` weights."""

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        if qweight.dtype != FP8_DTYPE or weight_scale.dtype != torch.float32:
            raise TypeError(f"expected {FP8_DTYPE} weights and float32 scales, "
                            f"got {qweight.dtype} and {weight_scale.dtype}")
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("weight_scale", weight_scale.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # The CPU path's decoded products come out FP16_DECODE_DIVISOR**2 too small; N
        # values, derived, so not saved.
        self.register_buffer("cpu_output_scale", weight_scale * FP16_DECODE_DIVISOR**2, persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        qweight, scale = quantize_fp8_weight(linear.weight.detach())
        return cls(qweight, scale, linear.bias)

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense ``[N, K]`` weight these buffers stand for (tests, references)."""
        return dequantize_fp8(self.qweight, self.weight_scale, dtype)

    def _cuda_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        from cadence.kernels.w8a8_fp8 import fp8_matmul  # imports triton: only when used

        return fp8_matmul(x2, self.qweight, self.weight_scale)

    def _cpu_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        dtype = cpu_policy().fp8_matmul_dtype()
        xq, x_scale = quantize_fp8_per_token(x2)
        x_codes = fp8_as_fp16_divided(xq).to(dtype)
        w_codes = fp8_as_fp16_divided(self.qweight).to(dtype)  # per call, freed after: memory stays 1 byte/weight
        if dtype != torch.float16 or self.in_features <= _FP16_SAFE_K:
            y = F.linear(x_codes, w_codes).float()
        else:
            y = torch.zeros(x2.shape[0], self.out_features)
            for x_part, w_part in zip(x_codes.split(_FP16_SAFE_K, 1), w_codes.split(_FP16_SAFE_K, 1)):
                y += F.linear(x_part, w_part).float()
        return y.mul_(x_scale[:, None]).mul_(self.cpu_output_scale).to(x2.dtype)  # y is ours: in place

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
