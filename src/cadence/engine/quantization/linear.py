"""Weight-only quantization methods: int8 per output channel (``Int8Method``), int4 per
group (``Int4Method``), both quantizing a dense checkpoint at load time.

Both hold the packed layouts of ``cadence.kernels.formats.quant_formats`` as buffers on their
``LinearLayer`` and dispatch by device:

* CUDA: the Triton GEMMs ``w8a16_matmul`` / ``w4a16_matmul``.
* CPU: the kernels of ``cpu_kernels`` (packed op, per-call or held dense copy, the half
  and integer GEMMs), the one ``cpu_planner`` chose by rule for every row, never the Triton
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

import torch
from torch import nn

from cadence.engine.quantization.linear_layer import (
    DenseMethod,
    LinearLayer,
    take_dense_weight,
)
from cadence.kernels.batch_invariant.cpu_linear import invariant_linear
from cadence.kernels.cpu import int8_dot
from cadence.kernels.cpu.chunked_linear import (
    ChunkMaker,
    chunk_bounds,
    chunked_half_matmul,
    chunked_matmul,
    held_chunks,
    held_half,
)
from cadence.kernels.cpu.int4_layout import (
    dequantize_cpu_int4_transposed,
    matching_block_n,
    unpack_cpu_int4,
)
from cadence.kernels.cpu.kernel_names import BF16DOT, DENSE, HALF_KERNELS, INT_DOT_LEVELS, KERNELS, PACKED
from cadence.kernels.formats.quant_formats import (
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


logger = logging.getLogger(__name__)


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
        return self.run_cpu_kernel(layer, x2, layer.cpu_kernel or self.cpu_kernels(layer)[0])

    # ---- the CPU kernels (kernels/cpu/kernel_names.py): what the planner chooses from

    def cpu_kernels(self, layer: LinearLayer) -> tuple[str, ...]:
        """The kernels of ``kernels/cpu/kernel_names.py`` this layer can run, the one for a layer without a
        plan first; () when its format has one CPU path."""
        return ()

    def run_cpu_kernel(self, layer: LinearLayer, x2: torch.Tensor, kernel: str) -> torch.Tensor:
        if kernel == PACKED:
            return self.packed_matmul(layer, x2)
        if kernel in HALF_KERNELS:
            if kernel not in layer.cpu_half:
                self.hold_half(layer, kernel)
            out = chunked_half_matmul(x2, layer.out_features, layer.cpu_half[kernel])  # fp32
            return out if x2.dtype == torch.float32 else out.to(x2.dtype)
        if kernel in INT_DOT_LEVELS:
            if kernel not in layer.cpu_int_dot:
                self.hold_int_dot(layer, kernel)
            return int8_dot.gemm(x2.float(), layer.cpu_int_dot[kernel], INT_DOT_LEVELS[kernel]).to(x2.dtype)
        held = layer.cpu_dense
        maker = held if kernel == DENSE and held is not None and layer.cpu_dense_dtype == x2.dtype else None
        maker = maker or self.dense_chunk_maker(layer, x2.dtype)
        return chunked_matmul(x2, layer.out_features, self.chunk_bounds(layer), maker)

    def hold_dense(self, layer: LinearLayer, dtype: torch.dtype) -> None:
        """Make and keep the ``dense`` kernel's chunks in ``dtype`` (``dense_bytes`` of memory)."""
        layer.cpu_dense = held_chunks(self.chunk_bounds(layer), self.dense_chunk_maker(layer, dtype))
        layer.cpu_dense_dtype = dtype

    @staticmethod
    def drop_dense(layer: LinearLayer) -> None:
        layer.cpu_dense, layer.cpu_dense_dtype = None, None

    def hold_half(self, layer: LinearLayer, kernel: str) -> None:
        """Make and keep a half kernel's packed chunks (its format's ``packed_bytes`` each)."""
        chunks = self.dense_chunk_maker(layer, torch.float32)
        layer.cpu_half[kernel] = held_half(kernel, self.chunk_bounds(layer), chunks)
        if kernel == BF16DOT:  # one packed weight: the layer's forward calls bf16dot itself
            (held,) = layer.cpu_half[kernel].values()
            layer.cpu_dot = held.packed  # type: ignore[assignment]

    @staticmethod
    def drop_half(layer: LinearLayer, kernel: str) -> None:
        layer.cpu_half.pop(kernel, None)
        if kernel == BF16DOT:
            layer.cpu_dot = None

    def hold_int_dot(self, layer: LinearLayer, kernel: str) -> None:
        """Make and keep an integer kernel's packed codes (``int8_dot.packed_bytes``)."""
        raise ValueError(f"{type(self).__name__} has no 4-bit codes for {kernel}")

    @staticmethod
    def drop_int_dot(layer: LinearLayer, kernel: str) -> None:
        layer.cpu_int_dot.pop(kernel, None)

    def packed_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def chunk_bounds(self, layer: LinearLayer) -> list[tuple[int, int]]:
        return chunk_bounds(layer.out_features, layer.in_features, 1)

    def dense_chunk_maker(self, layer: LinearLayer, dtype: torch.dtype) -> ChunkMaker:
        """``(start, stop) -> W[start:stop]`` dense in ``dtype``, contiguous, the same bits every call."""
        raise NotImplementedError


def dense_bytes(layer: LinearLayer, dtype: torch.dtype) -> int:
    """What a dense copy of the layer's weight takes in ``dtype``."""
    return layer.out_features * layer.in_features * torch.empty((), dtype=dtype).element_size()


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
        from cadence.kernels.triton.w8a16 import w8a16_matmul  # imports triton: only when used

        return w8a16_matmul(x2, layer.qweight, layer.scale, batch_invariant=layer.batch_invariant)

    def cpu_kernels(self, layer: LinearLayer) -> tuple[str, ...]:
        return tuple(k for k in KERNELS if k not in INT_DOT_LEVELS)  # they take 4-bit codes

    def packed_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        # Reads the int8 weight directly; only fast with bf16 activations.
        xb = x2.to(torch.bfloat16).contiguous()
        return torch.ops.aten._weight_int8pack_mm(xb, layer.qweight, layer.scale_bf16).to(x2.dtype)

    def dense_chunk_maker(self, layer: LinearLayer, dtype: torch.dtype) -> ChunkMaker:
        qweight, scale = layer.qweight, layer.scale.float()

        def chunk(start: int, stop: int) -> torch.Tensor:
            # The product is exact in fp32 (8 x 24 bits); one rounding to dtype.
            return (qweight[start:stop].float() * scale[start:stop, None]).to(dtype)

        return chunk


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

    def packed_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        xb = x2.to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            xb, layer.cpu_packed, layer.cpu_group_size, layer.cpu_scales_zeros
        )
        return y.to(x2.dtype)

    def cuda_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        from cadence.kernels.triton.w4a16 import w4a16_matmul  # imports triton: only when used

        return w4a16_matmul(x2, self.int4_weight(layer), batch_invariant=layer.batch_invariant)

    def cpu_matmul(self, layer: LinearLayer, x2: torch.Tensor) -> torch.Tensor:
        if layer.cpu_packed is None:
            # Shapes the CPU op refuses (N % 16, odd groups): dequantize per call. Slow but
            # rare (no Llama-family projection we serve has such a shape). Plain torch:
            # a CPU install need not have triton.
            return invariant_linear(x2, dequantize_int4(self.int4_weight(layer), x2.dtype))
        return super().cpu_matmul(layer, x2)

    def cpu_kernels(self, layer: LinearLayer) -> tuple[str, ...]:
        if layer.cpu_packed is None:
            return ()
        # Dense chunks come from unpacking torch's layout, which only a verified block width allows.
        if layer.cpu_block_n is None:
            return (PACKED,)
        # The integer kernels where K's blocks of 32 each have one scale; whether the CPU
        # runs them is the planner's to ask, once (it compiles them).
        blocks = layer.in_features % int8_dot.BLOCK == 0 and layer.cpu_group_size % int8_dot.BLOCK == 0
        return tuple(k for k in KERNELS if k not in INT_DOT_LEVELS or blocks)

    def hold_int_dot(self, layer: LinearLayer, kernel: str) -> None:
        # The codes and the packed op's own scales and zero terms, as the dense chunks read
        # them: code * scale + (zero - 8 * scale), in blocks of 32 along K.
        n, k, block_n = layer.out_features, layer.in_features, layer.cpu_block_n
        assert block_n is not None and layer.cpu_packed is not None and layer.cpu_scales_zeros is not None
        codes = unpack_cpu_int4(layer.cpu_packed.view(-1), n, k, block_n)
        repeat = layer.cpu_group_size // int8_dot.BLOCK
        scale = layer.cpu_scales_zeros[..., 0].float().t().repeat_interleave(repeat, dim=1)
        zero = layer.cpu_scales_zeros[..., 1].float().t().repeat_interleave(repeat, dim=1)
        layer.cpu_int_dot[kernel] = int8_dot.pack(codes, scale, zero - SYMMETRIC_ZERO * scale)

    def chunk_bounds(self, layer: LinearLayer) -> list[tuple[int, int]]:
        assert layer.cpu_block_n is not None  # cpu_kernels offers dense chunks only then
        return chunk_bounds(layer.out_features, layer.in_features, layer.cpu_block_n)

    def dense_chunk_maker(self, layer: LinearLayer, dtype: torch.dtype) -> ChunkMaker:
        # From the packed bytes, in whole row blocks (row blocks of block_n rows lie one
        # after another), with the packed op's own scales and zeros: the values it computes with.
        k, block_n, scales_zeros = layer.in_features, layer.cpu_block_n, layer.cpu_scales_zeros
        assert block_n is not None and scales_zeros is not None and layer.cpu_packed is not None
        packed_bytes = layer.cpu_packed.view(-1)
        group = layer.cpu_group_size

        def chunk(start: int, stop: int) -> torch.Tensor:
            transposed = dequantize_cpu_int4_transposed(
                packed_bytes[start * k // 2 : stop * k // 2],
                scales_zeros[:, start:stop],
                stop - start,
                k,
                group,
                block_n,
                dtype,
            )
            return transposed.t().contiguous()

        return chunk


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
