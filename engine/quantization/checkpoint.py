"""Pre-quantized GPTQ and AWQ checkpoints, loaded natively into ``Int4Linear`` layers.

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
``CheckpointQuantizer`` sits between the safetensors stream and the model's own
``load_weights``: it takes those tensors out of the stream, converts each projection
with ``from_gptq`` / ``from_awq`` into Cadence's ``Int4Weight`` as soon as its tensors
are in, concatenates q/k/v (and gate/up) along N into the fused layer, and swaps in an
``Int4Linear`` for the placeholder left in the model. Only the int4 tensors of one fused
layer are ever pending, so no dense copy of the model exists at any point.
Embeddings, norms and (unless ``lm_head``) the head stream through ``load_weights`` as
dense weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch import nn

from cadence.engine.quantization.linear import Int4Linear
from cadence.kernels.quant_formats import SYMMETRIC_ZERO, Int4Weight, from_awq, from_gptq

# HF projection (module name suffix) -> (our fused module suffix, shard index).
HF_PROJECTIONS: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}
# Our fused module suffix -> the HF projections it is built from, in N order.
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
LM_HEAD = "lm_head"
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
        return CheckpointQuantization("gptq", 4, group, bool(raw.get("sym", True)), fmt == "gptq",
                                      bool(raw.get("lm_head", False)))
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
        ours = {hf.rsplit(".", 1)[-1] for hf in HF_PROJECTIONS}
        if skipped & ours:
            raise ValueError(f"AWQ modules_to_not_convert={sorted(skipped)} (dense decoder projections) "
                             "is not supported")
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
        raise ValueError(f"{raw.get('quant_method')} group_size={group} is not supported "
                         "(must be -1 or a positive multiple of 8)")
    return group


# ---------------------------------------------------------------- Int4Weight concatenation


def concat_int4(weights: list[Int4Weight]) -> Int4Weight:
    """Concatenate same-K, same-group weights along N (our layout: dim 1 of every tensor)."""
    if len(weights) == 1:
        return weights[0]
    k, group = weights[0].in_features, weights[0].group_size
    for w in weights:
        if w.in_features != k or w.group_size != group:
            raise ValueError(f"cannot fuse int4 weights of different K/group: "
                             f"{[(x.in_features, x.group_size) for x in weights]}")
    dtype = weights[0].scales.dtype
    scales = torch.cat([w.scales.to(dtype) for w in weights], dim=1)
    zeros = None
    present = [w.zeros for w in weights if w.zeros is not None]
    if present:  # mixed: materialise the symmetric 8s; any real-valued zeros make all float
        zero_dtype = torch.float32 if any(z.is_floating_point() for z in present) else torch.uint8
        zeros = torch.cat([
            w.zeros.to(zero_dtype) if w.zeros is not None
            else torch.full(w.scales.shape, SYMMETRIC_ZERO, dtype=zero_dtype, device=w.scales.device)
            for w in weights
        ], dim=1)
    return Int4Weight(torch.cat([w.qweight for w in weights], dim=1), scales.contiguous(), zeros, group)


# ---------------------------------------------------------------- loading


class PendingInt4Linear(nn.Module):
    """Placeholder for a projection whose Int4Linear is built from the checkpoint stream.

    It has no parameters, so the model's ``load_weights`` neither expects nor loads a
    dense weight for it; running a model that still holds one is a loader bug.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pragma: no cover - guard only
        raise RuntimeError("quantized projection was never loaded from the checkpoint")


def install_placeholders(model: nn.Module, lm_head: bool = False) -> list[str]:
    """Replace each decoder projection ``nn.Linear`` with a PendingInt4Linear (on meta),
    and with ``lm_head`` the head too (a tied model gets a head of its own)."""
    names = []
    if lm_head:
        config = model.config  # type: ignore[union-attr]
        model.lm_head = PendingInt4Linear(config.hidden_size, config.vocab_size, False)
        names.append(LM_HEAD)
    for name, module in list(model.named_modules()):
        for suffix in FUSED_SHARDS:
            if name.endswith("." + suffix) and isinstance(module, nn.Linear):
                parent_name, child = name.rsplit(".", 1)
                parent = model.get_submodule(parent_name)
                setattr(parent, child, PendingInt4Linear(module.in_features, module.out_features,
                                                         module.bias is not None))
                names.append(name)
    return names


class CheckpointQuantizer:
    """Filters a weight stream: quantized projection tensors in, Int4Linear layers out.

    ``names`` is every tensor name in the checkpoint (safetensors headers, read up
    front), so a fused layer is built as soon as the last of its tensors has arrived,
    whatever order the files list them in.
    """

    def __init__(self, model: nn.Module, quant: CheckpointQuantization, names: Iterable[str],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model, self.quant, self.dtype, self.device = model, quant, dtype, device
        self.expected: dict[str, set[str]] = {}  # HF projection module -> tensor attrs present
        for name in names:
            proj = self._quantized_module(name)
            if proj is not None:
                self.expected.setdefault(proj[0], set()).add(name.rsplit(".", 1)[1])
        self.received: dict[str, dict[str, torch.Tensor]] = {}  # HF projection -> tensors so far
        self.converted: dict[str, dict[int, tuple[Int4Weight, torch.Tensor | None]]] = {}  # fused -> shards
        self.built = 0

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield the dense tensors; consume (and convert) the quantized projections'."""
        for name, tensor in weights:
            proj = self._quantized_module(name)
            if proj is None:
                yield name, tensor
                continue
            module, attr = proj
            if attr == "weight":
                raise ValueError(f"{name!r} is a dense weight in a {self.quant.method} checkpoint; "
                                 "checkpoints with some decoder projections left dense are not supported")
            if attr not in _REQUIRED + _OPTIONAL:
                raise ValueError(f"unexpected tensor {name!r} in a {self.quant.method} checkpoint")
            got = self.received.setdefault(module, {})
            got[attr] = tensor
            if set(got) >= self.expected[module] and all(a in got for a in _REQUIRED):
                self._convert(module, self.received.pop(module))

    def _quantized_module(self, name: str) -> tuple[str, str] | None:
        """(module, attr) of a tensor that belongs to a quantized layer, else None."""
        if self.quant.lm_head and name.startswith(LM_HEAD + "."):
            return LM_HEAD, name[len(LM_HEAD) + 1:]
        return projection_of(name)

    def _convert(self, hf_module: str, t: dict[str, torch.Tensor]) -> None:
        q = self.quant
        try:
            if q.method == "gptq":
                weight = from_gptq(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"),
                                   group_size=q.group_size, zero_minus_one=q.zero_minus_one)
            else:
                weight = from_awq(t["qweight"], t["qzeros"], t["scales"], group_size=q.group_size)
        except ValueError as exc:
            raise ValueError(f"{hf_module}: {exc}") from None
        if hf_module == LM_HEAD:
            self._build(LM_HEAD, [(weight, t.get("bias"))])
            return
        prefix, fused, shard = fused_of(hf_module)
        shards = self.converted.setdefault(prefix + fused, {})
        shards[shard] = (weight, t.get("bias"))
        if len(shards) == len(FUSED_SHARDS[fused]):
            self._build(prefix + fused, [shards[i] for i in range(len(shards))])
            del self.converted[prefix + fused]

    def _build(self, name: str, shards: list[tuple[Int4Weight, torch.Tensor | None]]) -> None:
        try:
            placeholder = self.model.get_submodule(name)
        except AttributeError:
            raise ValueError(f"unexpected quantized layer {name!r} in checkpoint") from None
        if not isinstance(placeholder, PendingInt4Linear):
            raise ValueError(f"quantized layer {name!r} appears twice in the checkpoint")
        weight = concat_int4([w for w, _ in shards])
        if (weight.in_features, weight.out_features) != (placeholder.in_features, placeholder.out_features):
            raise ValueError(
                f"shape mismatch for {name!r}: checkpoint K={weight.in_features}, N={weight.out_features}; "
                f"expected K={placeholder.in_features}, N={placeholder.out_features}"
            )
        bias = None
        if any(b is not None for _, b in shards):
            bias = torch.cat([b.to(self.dtype) if b is not None else torch.zeros(w.out_features, dtype=self.dtype)
                              for w, b in shards])
            if not placeholder.has_bias and not bool(bias.any()):
                bias = None  # GPTQ exporters often store an all-zero bias for bias-free layers
        if placeholder.has_bias and bias is None:
            raise ValueError(f"checkpoint is missing the bias of {name!r}")
        layer = Int4Linear(weight.to(self.device), None if bias is None else bias.to(self.device))
        parent_name, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent_name), child, layer)  # "" is the model itself
        self.built += 1

    def finish(self) -> None:
        """Raise if any quantized projection did not arrive in full."""
        missing = [f"{m} (no {', '.join(sorted(set(_REQUIRED) - set(t)))})" for m, t in self.received.items()]
        missing += [f"{name} (only shards {sorted(s)})" for name, s in self.converted.items()]
        missing += [n for n, m in self.model.named_modules()
                    if isinstance(m, PendingInt4Linear) and n not in self.converted]
        if missing:
            raise ValueError(f"{self.quant.method} checkpoint is missing quantized weights: {', '.join(missing[:8])}")


def projection_of(name: str) -> tuple[str, str] | None:
    """``model.layers.3.self_attn.q_proj.qweight`` -> (module, attr) for decoder projections."""
    if "." not in name:
        return None
    module, attr = name.rsplit(".", 1)
    for hf in HF_PROJECTIONS:
        if module.endswith("." + hf):
            return module, attr
    return None


def fused_of(hf_module: str) -> tuple[str, str, int]:
    """``model.layers.3.self_attn.k_proj`` -> ("model.layers.3.", "self_attn.qkv_proj", 1)."""
    for hf, (fused, shard) in HF_PROJECTIONS.items():
        if hf_module.endswith("." + hf):
            return hf_module[: -len(hf)], fused, shard
    raise KeyError(hf_module)
