"""Pre-quantized GPTQ and AWQ checkpoints, loaded natively into int4 layers (``CheckpointInt4Method``).

A checkpoint says it is pre-quantized with ``quantization_config`` in config.json.
Supported (everything else is refused with a ValueError naming what is unsupported):

* GPTQ: ``bits`` 4, any ``group_size`` (-1 = one group per row), ``desc_act`` false,
  ``sym`` true or false, ``checkpoint_format`` "gptq" (zero - 1 stored, the common
  AutoGPTQ "v1" format) or "gptq_v2" (zero stored); ``lm_head`` true quantizes the head
  the same way (with tied embeddings the lookup table stays dense);
* AWQ: ``bits``/``w_bit`` 4, ``group_size``/``q_group_size``, ``zero_point`` true,
  ``version`` "gemm".

Per projection (q/k/v/o/gate/up/down) the checkpoint holds ``*.qweight``, ``*.qzeros``,
``*.scales`` (GPTQ also ``*.g_idx``; optionally ``*.bias``) instead of ``*.weight``.
``CheckpointConfig`` gives every projection a ``CheckpointInt4Method``: the model's
``load_weights`` hands it those tensors shard by shard; once the last of a layer's
tensors (known from the safetensors headers) has arrived, it converts each shard with
``from_gptq`` / ``from_awq`` into Cadence's ``Int4Weight``, concatenates q/k/v (and
gate/up) along N and installs the int4 layout (``Int4Method.install``). Only packed
tensors are held, about one layer's at a time, so no dense copy of the model exists at
any point. Embeddings, norms and (unless ``lm_head``) the head load as dense weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cadence.engine.models.weight_names import SHARD_OF
from cadence.engine.quantization.linear import Int4Method
from cadence.engine.quantization.linear_layer import (
    LinearLayer,
    QuantConfig,
    QuantMethod,
    load_rows,
)
from cadence.kernels.formats.quant_formats import (
    SYMMETRIC_ZERO,
    Int4Weight,
    from_awq,
    from_gptq,
)

_REQUIRED = ("qweight", "qzeros", "scales")
_OPTIONAL = ("g_idx", "bias")
_AWQ_VERSIONS_REFUSED = ("gemv", "gemv_fast", "marlin", "exllama", "exllamav2", "ipex")


@dataclass(frozen=True)
class CheckpointQuantization:
    """A supported pre-quantized checkpoint format, parsed from ``quantization_config``."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1 (GPTQ): one group spanning K
    symmetric: bool  # GPTQ sym; AWQ always stores zero points (False)
    zero_minus_one: bool = True  # GPTQ v1 stores zero - 1
    lm_head: bool = False  # GPTQ's lm_head: the head is quantized too

    def describe(self) -> str:
        sym = "symmetric" if self.symmetric else "asymmetric"
        return f"{self.method} int{self.bits} g{self.group_size} {sym}"


def _get(cfg: dict[str, Any], *keys: str, default: Any = None) -> Any:
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    return default


def parse_quantization_config(raw: dict[str, Any] | None) -> CheckpointQuantization | None:
    """``config.json``'s ``quantization_config`` -> a supported format, or None if absent.

    ValueError, naming the unsupported setting, for anything Cadence cannot serve.
    """
    if not raw:
        return None
    if not isinstance(raw, dict):
        raise ValueError(f"quantization_config must be an object, got {type(raw).__name__}")
    method = str(raw.get("quant_method", "")).lower()
    if method == "gptq":
        bits = int(_get(raw, "bits", default=0))
        if bits != 4:
            raise ValueError(f"GPTQ checkpoints with bits={bits} are not supported; only 4-bit GPTQ loads")
        if raw.get("desc_act"):
            raise ValueError(
                "GPTQ act-order (desc_act=true) checkpoints are not supported; "
                "use a checkpoint quantized with desc_act=false"
            )
        if raw.get("dynamic"):
            raise ValueError("GPTQ per-module overrides ('dynamic') are not supported")
        fmt = str(raw.get("checkpoint_format") or "gptq").lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"GPTQ checkpoint_format {fmt!r} is not supported; use 'gptq' or 'gptq_v2'")
        group = _group_size(raw, "group_size")
        return CheckpointQuantization(
            "gptq", 4, group, bool(raw.get("sym", True)), fmt == "gptq", bool(raw.get("lm_head", False))
        )
    if method == "awq":
        bits = int(_get(raw, "bits", "w_bit", default=0))
        if bits != 4:
            raise ValueError(f"AWQ checkpoints with bits={bits} are not supported; only 4-bit AWQ loads")
        version = str(_get(raw, "version", default="gemm")).lower()
        if version != "gemm":
            what = "is" if version in _AWQ_VERSIONS_REFUSED else "is an unknown version and"
            raise ValueError(f"AWQ version {version!r} {what} not supported; only the 'gemm' layout loads")
        if not _get(raw, "zero_point", default=True):
            raise ValueError("AWQ checkpoints without zero points (zero_point=false) are not supported")
        skipped = set(raw.get("modules_to_not_convert") or [])
        ours = {hf.rsplit(".", 1)[-1] for hf in SHARD_OF}
        if skipped & ours:
            raise ValueError(
                f"AWQ modules_to_not_convert={sorted(skipped)} (dense decoder projections) is not supported"
            )
        group = _group_size(raw, "group_size", "q_group_size")
        if group == -1:
            raise ValueError("AWQ group_size=-1 is not supported")
        return CheckpointQuantization("awq", 4, group, False, False)
    raise ValueError(
        f"quantization_config quant_method {raw.get('quant_method')!r} is not supported; "
        "pre-quantized checkpoints load for 'gptq' and 'awq' (4-bit)"
    )


def _group_size(raw: dict[str, Any], *keys: str) -> int:
    group = int(_get(raw, *keys, default=128))
    if group != -1 and (group <= 0 or group % 8):
        raise ValueError(
            f"{raw.get('quant_method')} group_size={group} is not supported (must be -1 or a positive multiple of 8)"
        )
    return group


# ---------------------------------------------------------------- Int4Weight concatenation


def concat_int4(weights: list[Int4Weight]) -> Int4Weight:
    """Concatenate same-K, same-group weights along N (our layout: dim 1 of every tensor)."""
    if len(weights) == 1:
        return weights[0]
    k, group = weights[0].in_features, weights[0].group_size
    for w in weights:
        if w.in_features != k or w.group_size != group:
            raise ValueError(
                f"cannot fuse int4 weights of different K/group: {[(x.in_features, x.group_size) for x in weights]}"
            )
    dtype = weights[0].scales.dtype
    scales = torch.cat([w.scales.to(dtype) for w in weights], dim=1)
    zeros = None
    present = [w.zeros for w in weights if w.zeros is not None]
    if present:  # mixed: materialise the symmetric 8s; any real-valued zeros make all float
        zero_dtype = torch.float32 if any(z.is_floating_point() for z in present) else torch.uint8
        zeros = torch.cat(
            [
                w.zeros.to(zero_dtype)
                if w.zeros is not None
                else torch.full(w.scales.shape, SYMMETRIC_ZERO, dtype=zero_dtype, device=w.scales.device)
                for w in weights
            ],
            dim=1,
        )
    return Int4Weight(torch.cat([w.qweight for w in weights], dim=1), scales.contiguous(), zeros, group)


# ---------------------------------------------------------------- loading


class CheckpointInt4Method(Int4Method):
    """A GPTQ/AWQ projection: each shard's packed tensors are held as they stream in, and
    converted, joined along N and installed in the int4 layout as soon as the last of the
    layer's tensors has arrived, with no dense copy at any point. Only the bias is dense.

    ``tensor_names`` is every tensor name in the checkpoint (its safetensors headers), so
    a layer knows when it is complete whatever order the files list tensors in: the
    packed tensors read from a file are host copies, and holding all of them until the
    stream ends would hold the whole packed model in host memory.
    """

    def __init__(self, quant: CheckpointQuantization, device: torch.device, tensor_names: frozenset[str]) -> None:
        super().__init__(quant.group_size, quant.symmetric)
        self.quant, self.device, self.tensor_names = quant, device, tensor_names

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        layer.pending = [{} for _ in output_sizes]  # per shard: tensor name -> the checkpoint's tensor

    def load_weights(self, layer: LinearLayer, shard: int, name: str, tensor: torch.Tensor) -> None:
        full = layer.tensor_name(shard, name)
        if name == "weight":
            raise ValueError(
                f"{full!r} is a dense weight in a {self.quant.method} checkpoint; "
                "checkpoints with some decoder projections left dense are not supported"
            )
        if name == "bias":
            if layer.bias is None and not bool(tensor.any()):
                return  # GPTQ exporters often store an all-zero bias for bias-free layers
            load_rows(layer, "bias", shard, tensor, name)
            return
        if name not in _REQUIRED + _OPTIONAL:
            raise ValueError(f"unexpected tensor {full!r} in a {self.quant.method} checkpoint")
        layer.pending[shard][name] = tensor

    def expected_tensors(self, layer: LinearLayer) -> tuple[str, ...]:
        return QuantMethod.expected_tensors(self, layer)  # the packed ones are checked once all are in

    def is_complete(self, layer: LinearLayer) -> bool:
        return all(
            (shard, name) in layer.loaded
            for shard in range(len(layer.output_sizes))
            for name in _REQUIRED + _OPTIONAL
            if layer.tensor_name(shard, name) in self.tensor_names
        )

    def process_after_loading(self, layer: LinearLayer) -> None:
        modules = [layer.tensor_name(shard, "").rstrip(".") for shard in range(len(layer.output_sizes))]
        missing = [m for m, got in zip(modules, layer.pending) if not all(a in got for a in _REQUIRED)]
        if missing:
            raise ValueError(f"checkpoint is missing quantized weights: {', '.join(missing)}")
        weights = [self._convert(module, got) for module, got in zip(modules, layer.pending)]
        del layer.pending
        self.install(layer, concat_int4(weights).to(self.device))

    def _convert(self, module: str, t: dict[str, torch.Tensor]) -> Int4Weight:
        q = self.quant
        try:
            if q.method == "gptq":
                return from_gptq(
                    t["qweight"],
                    t["qzeros"],
                    t["scales"],
                    t.get("g_idx"),
                    group_size=q.group_size,
                    zero_minus_one=q.zero_minus_one,
                )
            return from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=q.group_size)
        except ValueError as exc:
            raise ValueError(f"{module}: {exc}") from None


class CheckpointConfig(QuantConfig):
    """A pre-quantized checkpoint: every decoder projection (and with GPTQ's ``lm_head``
    the head) loads its packed int4 tensors; embeddings and norms stay dense."""

    def __init__(self, quant: CheckpointQuantization, device: torch.device, tensor_names: frozenset[str]) -> None:
        self.quant, self.device, self.tensor_names = quant, device, tensor_names
        self.lm_head = CheckpointInt4Method(quant, device, tensor_names) if quant.lm_head else None

    def linear_method(self, prefix: str, shard_names: tuple[str, ...], input_size: int) -> QuantMethod:
        return CheckpointInt4Method(self.quant, self.device, self.tensor_names)
