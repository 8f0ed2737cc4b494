"""One interface for every weight format: ``QuantMethod``, and the ``LinearLayer`` it serves.

A model builds each projection as a ``LinearLayer`` with the method its ``QuantConfig``
chose (dense, int8, int4, fp8, a GPTQ/AWQ checkpoint's int4, a GGUF file's own blocks,
the int8 LM head). The method owns the layer's weights from start to end:

1. ``create_weights``: what the layer holds while the checkpoint streams in (on the meta
   device, before the model is given real storage): a dense staging weight for methods
   that quantize at load, nothing for those that read packed tensors;
2. ``load_weights``: where one checkpoint tensor of one fused shard (q, k or v; gate or
   up) lands;
3. ``process_after_loading``: once every shard is in, turn what was loaded into what
   ``apply`` reads (quantize, concatenate shards, repack for the CPU op), dropping the rest;
4. ``apply``: the forward.

The layer's bias is dense in every format and loaded the same way by all of them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cadence.kernels.batch_invariant.cpu_linear import invariant_linear
from cadence.kernels.cpu import bf16_dot

if TYPE_CHECKING:
    from cadence.kernels.cpu.chunked_linear import HeldHalf
    from cadence.kernels.cpu.int8_dot import DotWeight


class QuantMethod(ABC):
    """How one format creates, loads, finalises and applies a ``LinearLayer``'s weight."""

    @abstractmethod
    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        """Register what the layer holds while loading (``output_sizes``: one N per shard)."""

    def load_weights(self, layer: LinearLayer, shard: int, name: str, tensor: torch.Tensor) -> None:
        """Take the checkpoint tensor ``name`` ("weight", "qweight", "bias", ...) of ``shard``."""
        if name == "bias" and layer.bias is not None:
            load_rows(layer, "bias", shard, tensor, name)
            return
        raise ValueError(f"unexpected tensor {layer.tensor_name(shard, name)!r} for a {type(self).__name__} layer")

    def expected_tensors(self, layer: LinearLayer) -> tuple[str, ...]:
        """The tensor names every shard must bring from the checkpoint stream."""
        return ("bias",) if layer.bias is not None else ()

    def is_complete(self, layer: LinearLayer) -> bool:
        """Whether every tensor the layer takes from the checkpoint has arrived, so that it
        may be processed at once rather than after the whole stream (methods that hold
        host copies of what they load say so, to keep one layer's worth in memory)."""
        return False

    @abstractmethod
    def process_after_loading(self, layer: LinearLayer) -> None:
        """Turn the loaded tensors into the ones ``apply`` reads."""

    @abstractmethod
    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        """``[..., K]`` -> ``[..., N]`` in the activation dtype, bias included."""

    @abstractmethod
    def dequantized_weight(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        """The dense ``[N, K]`` weight the layer stands for (references, tests, tools)."""


class LinearLayer(nn.Module):
    """``y = x @ W.T + b`` with ``W`` held and applied as its ``QuantMethod`` says.

    ``output_sizes`` lists the N of each fused shard, in order along N, and
    ``shard_names`` their checkpoint module names (``q_proj``, ``k_proj``, ``v_proj``), so
    that methods reading tensors from elsewhere (a GGUF file) can find them; ``prefix``
    is the layer's module name in the model.
    """

    # What the methods hold on a layer (each registers only its own; typed here once).
    weight: nn.Parameter  # dense, and the staging weight of methods that quantize at load
    qweight: torch.Tensor  # int8 / fp8 [N, K]; int4 packed [K / 8, N] (a None buffer once repacked for CPU)
    scale: torch.Tensor  # int8: per output channel
    scale_bf16: torch.Tensor
    weight_scale: torch.Tensor  # fp8: per output channel
    cpu_output_scale: torch.Tensor
    scales: torch.Tensor | None  # int4: [K / group, N]
    zeros: torch.Tensor | None
    cpu_packed: torch.Tensor | None  # int4 in the layout of torch's CPU op
    cpu_scales_zeros: torch.Tensor | None
    group_size: int
    symmetric: bool
    cpu_block_n: int | None
    cpu_group_size: int
    dense_dtype: torch.dtype  # the dtype the staged dense weight was loaded in
    pending: list[dict[str, torch.Tensor]]  # packed checkpoint tensors per shard, until processed
    # CPU, quantized methods: the kernel every row runs (kernels/cpu/kernel_names.py, chosen by cpu_planner.py;
    # None: the format's first), and the dense copy the "dense" kernel reads, if held.
    cpu_kernel: str | None
    cpu_dense: Callable[[int, int], torch.Tensor] | None
    cpu_dense_dtype: torch.dtype | None
    cpu_half: dict[str, HeldHalf]  # the packed chunks of the half kernels ("fp16", "bf16") held
    cpu_int_dot: dict[str, DotWeight]  # the packed codes the integer kernels ("int8x2dot", "int8dot") held
    # CPU: the weight packed for bf16dot, which the forward then runs directly: a dense layer's
    # under the bf16 precision (engine/quantization/dense_dot.py), where it stands for
    # ``weight``, or a quantized layer's kept bf16 copy where the planner chose bf16dot.
    cpu_dot: bf16_dot.DotWeight | None
    weights_fixed: bool

    def __init__(
        self,
        input_size: int,
        output_sizes: list[int],
        bias: bool,
        method: QuantMethod,
        shard_names: tuple[str, ...] = ("",),
        prefix: str = "",
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
    ) -> None:
        super().__init__()
        if len(shard_names) != len(output_sizes):
            raise ValueError(f"{prefix}: {len(output_sizes)} output sizes for shards {shard_names}")
        self.in_features, self.out_features = input_size, sum(output_sizes)
        self.output_sizes, self.shard_names, self.prefix = list(output_sizes), shard_names, prefix
        self.method = method
        dtype = dtype or torch.get_default_dtype()
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features, dtype=dtype, device=device), requires_grad=False)
        method.create_weights(self, input_size, self.output_sizes, dtype, device)
        self.loaded: set[tuple[int, str]] = set()  # (shard, tensor name) seen while loading
        self.cpu_kernel, self.cpu_dense, self.cpu_dense_dtype = None, None, None
        self.cpu_half = {}
        self.cpu_int_dot = {}
        self.cpu_dot = None
        # Whether the weights stay the layer's own for the model's life, so copies made from
        # them once (the CPU planner's held kernels) stay right; not so for an offloaded
        # expert slot, which takes another expert's weights at every load.
        self.weights_fixed = True
        # Where Triton kernels serve the layer: one kernel configuration for every batch
        # size, so a row's bits do not depend on the batch (set by the engine,
        # engine/batch_invariant.py).
        self.batch_invariant = False
        self.processed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_dot is not None and not x.is_cuda:  # bf16dot, whatever the format: no dispatch
            return bf16_dot.linear(x, self.cpu_dot, self.bias)
        return self.method.apply(self, x)

    def load(self, shard: int, name: str, tensor: torch.Tensor) -> None:
        """One checkpoint tensor of one shard, through the method."""
        if (shard, name) in self.loaded:
            raise ValueError(f"{self.tensor_name(shard, name)!r} appears twice in the checkpoint")
        self.method.load_weights(self, shard, name, tensor)
        self.loaded.add((shard, name))
        if not self.processed and self.method.is_complete(self):
            self.process_after_loading()

    def missing(self) -> list[str]:
        """The expected checkpoint tensors that never arrived."""
        expected = self.method.expected_tensors(self)
        return [
            self.tensor_name(shard, name)
            for shard in range(len(self.output_sizes))
            for name in expected
            if (shard, name) not in self.loaded
        ]

    def process_after_loading(self) -> None:
        """Finish loading (once: a layer complete mid-stream is skipped at the end)."""
        if self.processed:
            return
        self.method.process_after_loading(self)
        self.processed = True

    def dequantized_weight(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.method.dequantized_weight(self, dtype)

    def shard_offset(self, shard: int) -> int:
        return sum(self.output_sizes[:shard])

    def tensor_name(self, shard: int, name: str) -> str:
        """The checkpoint's name for a tensor of one shard: ``model.layers.0.self_attn.k_proj.bias``."""
        parent = self.prefix.rpartition(".")[0]
        module = ".".join(p for p in (parent, self.shard_names[shard]) if p)
        return f"{module}.{name}"

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, method={type(self.method).__name__}"
        )


def load_rows(layer: LinearLayer, attr: str, shard: int, tensor: torch.Tensor, name: str) -> None:
    """Copy a shard's rows into the layer's dense ``attr`` (weight or bias), checking the shape."""
    dst = getattr(layer, attr).data.narrow(0, layer.shard_offset(shard), layer.output_sizes[shard])
    if dst.shape != tensor.shape:
        raise ValueError(
            f"shape mismatch for {layer.tensor_name(shard, name)!r}: checkpoint "
            f"{tuple(tensor.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(tensor)


class DenseMethod(QuantMethod):
    """An ordinary dense weight, ``[N, K]`` in the model's dtype, applied with ``F.linear``.

    Methods that quantize a dense checkpoint at load time derive from it: they stage the
    same weight while loading and replace it in ``process_after_loading``.
    """

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        weight = torch.empty(sum(output_sizes), input_size, dtype=dtype, device=device)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def load_weights(self, layer: LinearLayer, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name == "weight":
            load_rows(layer, "weight", shard, tensor, name)
        else:
            super().load_weights(layer, shard, name, tensor)

    def expected_tensors(self, layer: LinearLayer) -> tuple[str, ...]:
        return ("weight",) + super().expected_tensors(layer)

    def process_after_loading(self, layer: LinearLayer) -> None:
        pass

    def apply(self, layer: LinearLayer, x: torch.Tensor) -> torch.Tensor:
        if layer.batch_invariant:
            return batch_invariant_dense(x, layer.weight, layer.bias)
        if x.is_cuda:
            return F.linear(x, layer.weight, layer.bias)
        # (A layer packed for bf16dot never gets here: LinearLayer.forward runs it.)
        # CPU BLAS sums a row differently at different batch sizes; greedy tokens must not.
        return invariant_linear(x, layer.weight, layer.bias)

    def dequantized_weight(self, layer: LinearLayer, dtype: torch.dtype) -> torch.Tensor:
        if layer.cpu_dot is not None:
            return bf16_dot.unpack(layer.cpu_dot).to(dtype)
        return layer.weight.detach().to(dtype)


def batch_invariant_dense(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through the Triton GEMM with one configuration for every M, where cuBLAS
    would choose by M (``kernels/batch_invariant/triton_gemm.py``)."""
    from cadence.kernels.batch_invariant.triton_gemm import batch_invariant_linear  # imports triton: only when used

    return batch_invariant_linear(x, weight, bias)


def take_dense_weight(layer: LinearLayer) -> torch.Tensor:
    """The staged dense weight, removed from the layer (its memory goes with the last reference)."""
    weight = layer.weight.detach()
    del layer.weight
    return weight


class QuantConfig(ABC):
    """Chooses each ``LinearLayer``'s method while a model is built, from the checkpoint's
    format and the user's options. ``lm_head`` is the head's method; None keeps the head
    dense (or, with tied embeddings, absent: the embedding table serves as the head)."""

    lm_head: QuantMethod | None = None

    @abstractmethod
    def linear_method(self, prefix: str, shard_names: tuple[str, ...], input_size: int) -> QuantMethod:
        """The method for the decoder projection ``prefix`` built from ``shard_names``."""


class DenseConfig(QuantConfig):
    """Every projection dense, and the head too unless ``lm_head`` says otherwise."""

    def __init__(self, lm_head: QuantMethod | None = None) -> None:
        self.lm_head = lm_head

    def linear_method(self, prefix: str, shard_names: tuple[str, ...], input_size: int) -> QuantMethod:
        return DenseMethod()
