"""FP8 W8A8 (``Fp8Method``): e4m3 weights per output channel, e4m3 activations per token.

What vLLM's ``--quantization fp8`` does to a bf16/fp16 checkpoint ("dynamic" FP8): the
weight is quantized once, at load, to float8_e4m3fn with a float32 scale per output
channel; activations are quantized per token on every call (``kernels/formats/fp8_format.py``).
Embeddings and lm_head stay dense (``apply.TARGET_LAYERS``).

Dispatch by device:

* CUDA: ``fp8_matmul`` (``kernels/triton/w8a8_fp8.py``): ``torch._scaled_mm`` on compute
  capability 8.9+, the Triton kernel elsewhere. Imported only when used: a CPU install
  has no triton.
* CPU: the same W8A8 arithmetic in plain torch. Both operands' codes are decoded to
  fp16 (``fp8_as_fp16_divided``: exact, a few integer passes), multiplied by the fp16
  matmul (fp32 accumulation; fp32 on CPUs without fast fp16, see ``cpu_policy``), and
  the two scales applied to the output. The weight is decoded per call and never
  cached, so it stays one byte per weight.

Why the CPU path decodes codes rather than call ``torch._scaled_mm`` (which accepts CPU fp8 tensors with
row-wise scales) or an fp8 ``.to(bf16)`` cast: CPUs without fp8 arithmetic run both far
slower than the integer decode, at every batch size and shape measured (bench/RESULTS.md,
"FP8 W8A8 linear on CPU"; ``python bench/cpu_linear.py --fp8``). The per-call weight decode
still keeps this path well behind dense bf16: on CPU fp8 buys memory and the GPU's W8A8
arithmetic, not speed, and int8 is the faster CPU choice.

``Fp8Linear`` builds a standalone layer from ready tensors (benches, tests). Outputs are
in the activation dtype; bias is added in it.
"""

from __future__ import annotations

import torch
from torch import nn

from cadence.engine.quantization.linear import QuantizedMethod, _ready_tensors, check_shape
from cadence.engine.quantization.linear_layer import LinearLayer, take_dense_weight
from cadence.kernels.batch_invariant.cpu_linear import invariant_linear
from cadence.kernels.cpu.quant_policy import cpu_policy
from cadence.kernels.formats.fp8_format import (
    FP8_DTYPE,
    FP16_DECODE_DIVISOR,
    dequantize_fp8,
    fp8_as_fp16_divided,
    quantize_fp8_per_token,
    quantize_fp8_weight,
)

# A decoded code is at most 448 / 256 = 1.75, so a K-long row of products is at most
# 1.75**2 * K: the fp16 output of the CPU matmul holds it for K up to this. Longer rows
# are cut into chunks of it, summed in fp32.
_FP16_SAFE_K = int(torch.finfo(torch.float16).max / (448.0 / FP16_DECODE_DIVISOR) ** 2)


class Fp8Method(QuantizedMethod):
    """``y = quant(x) @ (qweight * weight_scale[:, None]).T + bias`` with e4m3 ``[N, K]`` weights."""

    def process_after_loading(self, layer: LinearLayer) -> None:
        self.install(layer, *quantize_fp8_weight(take_dense_weight(layer)))

    @staticmethod
    def install(layer: LinearLayer, qweight: torch.Tensor, weight_scale: torch.Tensor) -> None:
        if qweight.dtype != FP8_DTYPE or weight_scale.dtype != torch.float32:
            raise TypeError(
                f"expected {FP8_DTYPE} weights and float32 scales, got {qweight.dtype} and {weight_scale.dtype}"
            )
        check_shape(layer, qweight.shape[1], qweight.shape[0])
        layer.register_buffer("qweight", qweight.contiguous())
        layer.register_buffer("weight_scale", weight_scale.contiguous())
        # The CPU path's decoded products come out FP16_DECODE_DIVISOR**2 too small; N
        # values, derived, so not saved.
        layer.register_buffer("cpu_output_scale", weight_scale * FP16_DECODE_DIVISOR**2, persistent=False)

    def dequantized_weight(self, layer: LinearLayer, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize_fp8(layer.qweight, layer.weight_scale, dtype)

    def cuda_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        from cadence.kernels.triton.w8a8_fp8 import (
            fp8_matmul,  # imports triton: only when used
        )

        return fp8_matmul(x2, layer.qweight, layer.weight_scale, batch_invariant=layer.batch_invariant)

    def cpu_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        dtype = cpu_policy().fp8_matmul_dtype()
        xq, x_scale = quantize_fp8_per_token(x2)
        x_codes = fp8_as_fp16_divided(xq).to(dtype)
        w_codes = fp8_as_fp16_divided(layer.qweight).to(dtype)  # per call, freed after: memory stays 1 byte/weight
        if dtype != torch.float16 or layer.in_features <= _FP16_SAFE_K:
            y = invariant_linear(x_codes, w_codes).float()  # a row's bits must not follow the batch
        else:
            y = torch.zeros(x2.shape[0], layer.out_features)
            for x_part, w_part in zip(x_codes.split(_FP16_SAFE_K, 1), w_codes.split(_FP16_SAFE_K, 1)):
                y += invariant_linear(x_part, w_part.contiguous()).float()
        return y.mul_(x_scale[:, None]).mul_(layer.cpu_output_scale).to(x2.dtype)  # y is ours: in place


class Fp8Linear(LinearLayer):
    """A standalone ``LinearLayer`` served by ``Fp8Method``, from ready fp8 tensors."""

    def __init__(self, qweight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n, k = qweight.shape
        super().__init__(k, [n], False, Fp8Method(), device=torch.device("meta"))
        _ready_tensors(self, bias)
        Fp8Method.install(self, qweight, weight_scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Fp8Linear:
        qweight, scale = quantize_fp8_weight(linear.weight.detach())
        return cls(qweight, scale, linear.bias)
