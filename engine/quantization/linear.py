"""Weight-only quantized replacements for ``nn.Linear``: int8 per channel, int4 per group.

Both hold the packed layouts of ``cadence.kernels.quant_formats`` as buffers (plus an
optional bias) and dispatch by device:

* CUDA: the Triton GEMMs ``w8a16_matmul`` / ``w4a16_matmul``.
* CPU: torch paths chosen by ``cpu_policy`` (see there for the measurements), never the
  Triton interpreter, even when the test suite sets ``TRITON_INTERPRET=1``.
  ``Int4Linear`` converts its weight once, at construction, into the layout
  ``_weight_int4pack_mm_for_cpu`` reads and then drops the Cadence-layout copy, so the
  weight is held once, not twice.

Quantize on the device the model will run on: a CPU-converted ``Int4Linear`` cannot be
moved to CUDA afterwards. Outputs are in the activation dtype; bias is added in it.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cadence.engine.quantization.cpu_int4_layout import dequantize_cpu_int4_transposed, matching_block_n
from cadence.engine.quantization.cpu_policy import cpu_policy
from cadence.kernels.quant_formats import (
    SYMMETRIC_ZERO,
    Int4Weight,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)

# The CPU int4 op packs N in blocks of 16 and accepts these group sizes.
_CPU_INT4_GROUPS = (32, 64, 128, 256)
# Int8Linear's and Int4Linear's per-call dense copy is made this many weights at a time
# (output rows in chunks). A vocabulary-sized head (49,152 x 576) dequantized whole is a 56 MB bf16
# temporary, freshly mapped and page-faulted on every call: 55-70 ms at M = 32-64,
# against 15-18 ms in ~2M-weight chunks, which also beat the dense fp32 head there.
DEQUANT_CHUNK_ELEMENTS = 1 << 21


logger = logging.getLogger(__name__)


def _matmul_in_row_chunks(
    x: torch.Tensor, n: int, k: int, row_multiple: int, dense_t: Callable[[int, int], torch.Tensor]
) -> torch.Tensor:
    """``x [M, K] @ W.T`` for an ``[N, K]`` weight held quantized, where ``dense_t(start,
    stop)`` makes ``W[start:stop].T`` dense for this call: ``DEQUANT_CHUNK_ELEMENTS``
    weights at a time (a multiple of ``row_multiple`` rows), so no temporary is ever
    weight-sized. A weight under that size is one chunk."""
    rows = max(row_multiple, DEQUANT_CHUNK_ELEMENTS // k // row_multiple * row_multiple)
    if rows >= n:
        return torch.matmul(x, dense_t(0, n))
    out = torch.empty(x.shape[0], n, dtype=x.dtype)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        out[:, start:stop] = torch.matmul(x, dense_t(start, stop))
    return out


class QuantizedLinear(nn.Module):
    """What every quantized projection shares: ``[..., K]`` in, ``[..., N]`` out in the
    activation dtype, a kernel on CUDA and a torch path on CPU, bias added last."""

    in_features: int
    out_features: int
    bias: torch.Tensor | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        y = self._cuda_matmul(x2) if x.is_cuda else self._cpu_matmul(x2)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)

    def _cuda_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _cpu_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Linear(QuantizedLinear):
    """``y = x @ (qweight * scale[:, None]).T + bias`` with int8 ``[N, K]`` weights."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = qweight.shape
        self.register_buffer("qweight", qweight.contiguous())
        self.register_buffer("scale", scale.contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        # _weight_int8pack_mm wants the scale in the activation dtype (bf16 here); N
        # values, so keeping a second copy costs nothing next to the weight.
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Int8Linear":
        qweight, scale = quantize_int8(linear.weight.detach())
        return cls(qweight, scale, linear.bias)

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense ``[N, K]`` weight these buffers stand for (tests, references)."""
        return dequantize_int8(self.qweight, self.scale, dtype)

    def _cuda_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        from cadence.kernels.w8a16 import w8a16_matmul  # imports triton: only when used

        return w8a16_matmul(x2, self.qweight, self.scale)

    def _cpu_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        policy = cpu_policy()
        if x2.shape[0] <= policy.int8_packed_max_m:
            # Packed op: reads the int8 weight directly; only fast with bf16 activations.
            xb = x2.to(torch.bfloat16).contiguous()
            return torch.ops.aten._weight_int8pack_mm(xb, self.qweight, self.scale_bf16).to(x2.dtype)
        # Large M: the packed op is compute-bound and slow; a per-call dense copy (freed
        # right after) lets the AMX/BLAS matmul run. Never cached: that would undo the
        # memory saving.
        dtype = policy.dense_dtype(x2.dtype)
        scale = self.scale_bf16 if dtype == torch.bfloat16 else self.scale.to(dtype)
        def dense_t(start: int, stop: int) -> torch.Tensor:
            return (self.qweight[start:stop].to(dtype) * scale[start:stop, None]).t()

        return _matmul_in_row_chunks(x2.to(dtype), self.out_features, self.in_features, 1, dense_t).to(x2.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Int4Linear(QuantizedLinear):
    """``y = x @ dequant(Int4Weight).T + bias`` with group-wise int4 weights."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = weight.in_features, weight.out_features
        self.group_size = weight.group_size
        self.symmetric = weight.zeros is None
        self.register_buffer("qweight", weight.qweight.contiguous())
        self.register_buffer("scales", weight.scales.contiguous())
        self.register_buffer("zeros", weight.zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().clone())
        self.register_buffer("cpu_packed", None)
        self.register_buffer("cpu_scales_zeros", None)
        self.cpu_block_n: int | None = None  # set when the packed bytes can be unpacked again
        self.cpu_group_size = self.group_size  # the group the CPU op is given (divides group_size)
        if weight.qweight.device.type == "cpu":
            self._convert_for_cpu()

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = True) -> "Int4Linear":
        return cls(quantize_int4(linear.weight.detach(), group_size, symmetric), linear.bias)

    @property
    def cpu_ready(self) -> bool:
        """Whether the CPU packed op serves this layer (else the dequantizing fallback)."""
        return self.cpu_packed is not None

    def int4_weight(self) -> Int4Weight:
        """The Cadence-layout weight; gone once converted for the CPU op (memory)."""
        if self.qweight is None:
            raise RuntimeError("this Int4Linear was converted to the CPU packed layout; "
                               "keep the Int4Weight it was built from to dequantize it")
        return Int4Weight(self.qweight, self.scales, self.zeros, self.group_size)

    def _convert_for_cpu(self) -> None:
        n, g = self.out_features, self.group_size
        # A group the op does not take but a multiple of one it does (GPTQ's group_size=-1
        # is one group spanning K) splits exactly into that smaller group, scales repeated.
        cpu_group = next((c for c in reversed(_CPU_INT4_GROUPS) if g % c == 0), None)
        if n % 16 or cpu_group is None:
            # The op cannot take this shape: forward dequantizes the whole weight per call.
            logger.warning(
                "int4 layer %dx%d with group %d has no fast CPU path; it will dequantize on every call",
                n, self.in_features, g,
            )
            return
        codes = unpack_int4(Int4Weight(self.qweight, self.scales, self.zeros, g)).t()  # uint8 [N, K]
        self.cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
        # Prefill-sized batches dequantize from the packed bytes instead (see forward).
        self.cpu_block_n = matching_block_n(self.cpu_packed, codes)
        # The op computes (code - 8) * scale + zero_term; ours is (code - z) * scale, so
        # zero_term = (8 - z) * scale (zero for symmetric weights).
        scales = self.scales.float().repeat_interleave(g // cpu_group, dim=0)
        z = SYMMETRIC_ZERO if self.zeros is None else self.zeros.float().repeat_interleave(g // cpu_group, dim=0)
        zero_term = (SYMMETRIC_ZERO - z) * scales
        self.cpu_scales_zeros = torch.stack([scales, zero_term.expand_as(scales)], dim=2).to(torch.bfloat16).contiguous()
        # Keep the weight once: the CPU layout is the same size as ours (N*K/2 bytes), and
        # cpu_scales_zeros replaces our scales and zeros.
        self.qweight = self.scales = self.zeros = None
        self.cpu_group_size = cpu_group

    def _cpu_packed_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        xb = x2.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, self.cpu_packed, self.cpu_group_size, self.cpu_scales_zeros)
        return y.to(x2.dtype)

    def _cuda_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        from cadence.kernels.w4a16 import w4a16_matmul  # imports triton: only when used

        return w4a16_matmul(x2, self.int4_weight())

    def _cpu_matmul(self, x2: torch.Tensor) -> torch.Tensor:
        if self.cpu_packed is None:
            # Shapes the CPU op refuses (N % 16, odd groups): dequantize per call. Slow but
            # rare (no Llama-family projection we serve has such a shape). Plain torch:
            # a CPU install need not have triton.
            return F.linear(x2, dequantize_int4(self.int4_weight(), x2.dtype))
        if x2.shape[0] <= cpu_policy().int4_packed_max_m or self.cpu_block_n is None:
            return self._cpu_packed_matmul(x2)
        # Large M: the packed op is compute-bound; a per-call bf16 copy of the weight
        # (freed right after) lets the AMX matmul run, as for int8, in chunks of whole
        # packed row blocks once the weight is large.
        k, block_n = self.in_features, self.cpu_block_n
        packed_bytes = self.cpu_packed.view(-1)  # row blocks of block_n rows lie one after another

        def dense_t(start: int, stop: int) -> torch.Tensor:
            return dequantize_cpu_int4_transposed(packed_bytes[start * k // 2 : stop * k // 2],
                                                  self.cpu_scales_zeros[:, start:stop], stop - start, k,
                                                  self.cpu_group_size, block_n)

        return _matmul_in_row_chunks(x2.to(torch.bfloat16), self.out_features, k, block_n, dense_t).to(x2.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"group_size={self.group_size}, symmetric={self.symmetric}, cpu_packed={self.cpu_ready}")

