"""Weight-only quantization methods: int8 per output channel (``Int8Method``), int4 per
group (``Int4Method``), both quantizing a dense checkpoint at load time.

Both hold the packed layouts of ``cadence.kernels.quant_formats`` as buffers on their
``LinearLayer`` and dispatch by device:

* CUDA: the Triton GEMMs ``w8a16_matmul`` / ``w4a16_matmul``.
* CPU: torch paths chosen by ``cpu_policy`` (see there for why), never the Triton
  interpreter, even when the test suite sets ``TRITON_INTERPRET=1``. ``Int4Method``
  converts a CPU weight once, after loading, into the layout ``_weight_int4pack_mm_for_cpu``
  reads and then drops the Cadence-layout copy, so the weight is held once, not twice.

The GPTQ/AWQ and GGUF methods reuse these ``install`` and ``apply`` steps with their own
loading. ``Int8Linear`` / ``Int4Linear`` build a standalone layer from ready tensors
(kernel tests, benches). Quantize on the device the model will run on: a CPU-converted
int4 layer cannot be moved to CUDA afterwards. Outputs are in the activation dtype; bias
is added in it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from cadence.engine.quantization.cpu_int4_layout import (
    dequantize_cpu_int4_transposed,
    matching_block_n,
)
from cadence.engine.quantization.cpu_policy import cpu_policy
from cadence.engine.quantization.method import (
    DenseMethod,
    LinearLayer,
    take_dense_weight,
)
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
# The per-call dense copy of an int8/int4 weight is made this many weights at a time
# (output rows in chunks): a vocabulary-sized head dequantized whole is a temporary
# freshly mapped and page-faulted on every call, several times slower than ~2M-weight
# chunks (bench/RESULTS.md).
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


def check_shape(layer: LinearLayer, in_features: int, out_features: int) -> None:
    if (in_features, out_features) != (layer.in_features, layer.out_features):
        raise ValueError(
            f"shape mismatch for {layer.prefix!r}: the weights give K={in_features}, N={out_features}; "
            f"the model expects K={layer.in_features}, N={layer.out_features}"
        )


class QuantizedMethod(DenseMethod):
    """What every quantized method's forward shares: ``[..., K]`` in, ``[..., N]`` out in
    the activation dtype, a kernel on CUDA and a torch path on CPU, bias added last.
    Loading stages a dense weight (``DenseMethod``) that ``process_after_loading`` quantizes."""

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, layer.in_features)
        y = self.cuda_matmul(layer, x2) if x.is_cuda else self.cpu_matmul(layer, x2)
        if layer.bias is not None:
            y = y + layer.bias.to(y.dtype)
        return y.reshape(*lead, layer.out_features)

    def cuda_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def cpu_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class Int8Method(QuantizedMethod):
    """``y = x @ (qweight * scale[:, None]).T + bias`` with int8 ``[N, K]`` weights."""

    def process_after_loading(self, layer: LinearLayer) -> None:
        dense = take_dense_weight(layer)
        layer.dense_dtype = dense.dtype  # what the layer computed in before (an Int8Embedding returns it)
        self.install(layer, *self.quantize(dense))

    def quantize(self, dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(qweight int8 ``[N, K]``, scale ``[N]``) of the staged weight; the scale in its dtype."""
        return quantize_int8(dense)

    @staticmethod
    def install(layer: LinearLayer, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        check_shape(layer, qweight.shape[1], qweight.shape[0])
        layer.register_buffer("qweight", qweight.contiguous())
        layer.register_buffer("scale", scale.contiguous())
        # _weight_int8pack_mm wants the scale in the activation dtype (bf16 here); N
        # values, so keeping a second copy costs nothing next to the weight.
        layer.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)

    def dequantized_weight(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int8(layer.qweight, layer.scale, dtype)

    def cuda_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        from cadence.kernels.w8a16 import w8a16_matmul  # imports triton: only when used

        return w8a16_matmul(x2, layer.qweight, layer.scale)

    def cpu_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        policy = cpu_policy()
        if x2.shape[0] <= policy.int8_packed_max_m:
            # Packed op: reads the int8 weight directly; only fast with bf16 activations.
            xb = x2.to(torch.bfloat16).contiguous()
            return torch.ops.aten._weight_int8pack_mm(xb, layer.qweight, layer.scale_bf16).to(x2.dtype)
        # Large M: the packed op is compute-bound and slow; a per-call dense copy (freed
        # right after) lets the AMX/BLAS matmul run. Never cached: that would undo the
        # memory saving.
        dtype = policy.dense_dtype(x2.dtype)
        scale = layer.scale_bf16 if dtype == torch.bfloat16 else layer.scale.to(dtype)

        def dense_t(start: int, stop: int) -> torch.Tensor:
            return (layer.qweight[start:stop].to(dtype) * scale[start:stop, None]).t()

        return _matmul_in_row_chunks(x2.to(dtype), layer.out_features, layer.in_features, 1, dense_t).to(x2.dtype)


class Int4Method(QuantizedMethod):
    """``y = x @ dequant(Int4Weight).T + bias`` with group-wise int4 weights.

    The layer holds ``qweight``/``scales``/``zeros`` in Cadence's layout, or on CPU
    ``cpu_packed``/``cpu_scales_zeros`` in the layout of torch's packed op instead.
    """

    def __init__(self, group_size: int = 128, symmetric: bool = True) -> None:
        self.group_size, self.symmetric = group_size, symmetric

    def process_after_loading(self, layer: LinearLayer) -> None:
        self.install(layer, quantize_int4(take_dense_weight(layer), self.group_size, self.symmetric))

    def install(self, layer: LinearLayer, weight: Int4Weight) -> None:
        """Hold ``weight`` (on the device it is on), converted for the CPU op there."""
        check_shape(layer, weight.in_features, weight.out_features)
        layer.group_size = weight.group_size
        layer.symmetric = weight.zeros is None
        layer.register_buffer("qweight", weight.qweight.contiguous())
        layer.register_buffer("scales", weight.scales.contiguous())
        layer.register_buffer("zeros", weight.zeros)
        layer.register_buffer("cpu_packed", None)
        layer.register_buffer("cpu_scales_zeros", None)
        layer.cpu_block_n = None  # set when the packed bytes can be unpacked again
        layer.cpu_group_size = layer.group_size  # the group the CPU op is given (divides group_size)
        if weight.qweight.device.type == "cpu":
            self.convert_for_cpu(layer)

    @staticmethod
    def cpu_ready(layer: LinearLayer) -> bool:
        """Whether the CPU packed op serves this layer (else the dequantizing fallback)."""
        return layer.cpu_packed is not None

    @staticmethod
    def int4_weight(layer: LinearLayer) -> Int4Weight:
        """The Cadence-layout weight; gone once converted for the CPU op (memory)."""
        if layer.qweight is None or layer.scales is None:
            raise RuntimeError(
                "this int4 layer was converted to the CPU packed layout; "
                "keep the Int4Weight it was built from to dequantize it"
            )
        return Int4Weight(layer.qweight, layer.scales, layer.zeros, layer.group_size)

    def dequantized_weight(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        if layer.qweight is not None:
            return dequantize_int4(self.int4_weight(layer), dtype)
        return self.cpu_matmul(layer, torch.eye(layer.in_features)).t().to(dtype)

    def convert_for_cpu(self, layer: LinearLayer) -> None:
        n, g = layer.out_features, layer.group_size
        # A group the op does not take but a multiple of one it does (GPTQ's group_size=-1
        # is one group spanning K) splits exactly into that smaller group, scales repeated.
        cpu_group = next((c for c in reversed(_CPU_INT4_GROUPS) if g % c == 0), None)
        if n % 16 or cpu_group is None:
            # The op cannot take this shape: forward dequantizes the whole weight per call.
            logger.warning(
                "int4 layer %dx%d with group %d has no fast CPU path; it will dequantize on every call",
                n,
                layer.in_features,
                g,
            )
            return
        weight = self.int4_weight(layer)
        codes = unpack_int4(weight).t()  # uint8 [N, K]
        layer.cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 2)
        # Prefill-sized batches dequantize from the packed bytes instead (see cpu_matmul).
        layer.cpu_block_n = matching_block_n(layer.cpu_packed, codes)
        # The op computes (code - 8) * scale + zero_term; ours is (code - z) * scale, so
        # zero_term = (8 - z) * scale (zero for symmetric weights).
        scales = weight.scales.float().repeat_interleave(g // cpu_group, dim=0)
        z = SYMMETRIC_ZERO if weight.zeros is None else weight.zeros.float().repeat_interleave(g // cpu_group, dim=0)
        zero_term = (SYMMETRIC_ZERO - z) * scales
        layer.cpu_scales_zeros = (
            torch.stack([scales, zero_term.expand_as(scales)], dim=2).to(torch.bfloat16).contiguous()
        )
        # Keep the weight once: the CPU layout is the same size as ours (N*K/2 bytes), and
        # cpu_scales_zeros replaces our scales and zeros.
        for name in ("qweight", "scales", "zeros"):
            layer.register_buffer(name, None)
        layer.cpu_group_size = cpu_group

    @staticmethod
    def cpu_packed_matmul(layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        xb = x2.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, layer.cpu_packed, layer.cpu_group_size, layer.cpu_scales_zeros
        )
        return y.to(x2.dtype)

    def cuda_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        from cadence.kernels.w4a16 import w4a16_matmul  # imports triton: only when used

        return w4a16_matmul(x2, self.int4_weight(layer))

    def cpu_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        if layer.cpu_packed is None:
            # Shapes the CPU op refuses (N % 16, odd groups): dequantize per call. Slow but
            # rare (no Llama-family projection we serve has such a shape). Plain torch:
            # a CPU install need not have triton.
            return F.linear(x2, dequantize_int4(self.int4_weight(layer), x2.dtype))
        if x2.shape[0] <= cpu_policy().int4_packed_max_m or layer.cpu_block_n is None:
            return self.cpu_packed_matmul(layer, x2)
        # Large M: the packed op is compute-bound; a per-call bf16 copy of the weight
        # (freed right after) lets the AMX matmul run, as for int8, in chunks of whole
        # packed row blocks once the weight is large.
        k, block_n, scales_zeros = layer.in_features, layer.cpu_block_n, layer.cpu_scales_zeros
        assert scales_zeros is not None  # set with cpu_packed
        packed_bytes = layer.cpu_packed.view(-1)  # row blocks of block_n rows lie one after another

        def dense_t(start: int, stop: int) -> torch.Tensor:
            return dequantize_cpu_int4_transposed(
                packed_bytes[start * k // 2 : stop * k // 2],
                scales_zeros[:, start:stop],
                stop - start,
                k,
                layer.cpu_group_size,
                block_n,
            )

        return _matmul_in_row_chunks(x2.to(torch.bfloat16), layer.out_features, k, block_n, dense_t).to(x2.dtype)


# ---------------------------------------------------------------- standalone layers


def _ready_tensors(layer: LinearLayer, bias: torch.Tensor | None) -> None:
    """Drop the (meta, never loaded) staging weight of a layer built from ready tensors; keep ``bias``."""
    take_dense_weight(layer)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)


class Int8Linear(LinearLayer):
    """A standalone ``LinearLayer`` served by ``Int8Method``, from ready int8 tensors."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        n, k = qweight.shape
        super().__init__(k, [n], False, Int8Method(), device=torch.device("meta"))
        _ready_tensors(self, bias)
        Int8Method.install(self, qweight, scale)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        qweight, scale = quantize_int8(linear.weight.detach())
        return cls(qweight, scale, linear.bias)


class Int4Linear(LinearLayer):
    """A standalone ``LinearLayer`` served by ``Int4Method``, from a ready ``Int4Weight``."""

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None) -> None:
        method = Int4Method(weight.group_size, weight.zeros is None)
        super().__init__(weight.in_features, [weight.out_features], False, method, device=torch.device("meta"))
        _ready_tensors(self, bias)
        method.install(self, weight)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 128, symmetric: bool = True) -> Int4Linear:
        return cls(quantize_int4(linear.weight.detach(), group_size, symmetric), linear.bias)

    @property
    def cpu_ready(self) -> bool:
        return Int4Method.cpu_ready(self)

    def int4_weight(self) -> Int4Weight:
        return Int4Method.int4_weight(self)
