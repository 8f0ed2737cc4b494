"""Serve a GGUF file's own Q4_0 / Q4_1 / Q8_0 projection weights (``--quantization gguf``).

A GGUF is first converted into a cached HF folder (``engine/gguf_loader.py``), which holds
dense copies of every tensor. With ``quantization="gguf"`` the loader takes the decoder
projections from the GGUF file itself instead, block by block, straight into Cadence's
quantized layers:

* Q4_0 (per 32 weights: fp16 ``d``, codes 0..15; ``w = (code - 8) * d``) is exactly our
  symmetric int4 with group 32 and ``scales = d``.
* Q4_1 (fp16 ``d`` and ``min``; ``w = code * d + min``) is our asymmetric int4 with
  group 32 and a real-valued zero point ``z = -min / d`` (float32), so ``(code - z) * d``
  gives the file's values to fp32 rounding (the GPU kernel; the CPU op rounds scales and
  zero terms to bf16). A block with ``d == 0`` holds ``min`` only: it is stored as code 9,
  zero 8, scale ``min``.
* Q8_0 (fp16 ``d``, int8 codes; ``w = code * d``) has a scale per 32 weights, but our
  int8 layout (and torch's CPU int8 op) has one per output channel. Q8_0 rows are
  therefore re-quantized per channel from their exact values: one more rounding, about as
  large as quantizing the dense weight to int8 directly.

Codes are never widened to a float matrix. Q and K rows are un-permuted (llama.cpp
interleaves RoPE halves) on the codes and block scales, which are per row. q/k/v and
gate/up are concatenated along N into our fused layers. A fused layer whose shards are
not all int4 types or all Q8_0 (say Q6_K, or a mix) stays dense, loaded from the
converted folder, and is logged. Norms stay dense. The LM head (with a tied embedding)
becomes int8 per vocabulary row when the file stores it quantized, as llama.cpp files
usually do (Q8_0 or Q6_K), re-quantized from the block values (``lm_head.py``).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from torch import nn

from cadence.engine.gguf_loader import SOURCE_FILE, cache_key, unpermute_rope_rows
from cadence.engine.quantization.checkpoint import (
    FUSED_SHARDS,
    PendingInt4Linear,
    fused_of,
    projection_of,
    concat_int4,
)
from cadence.engine.quantization.linear import Int4Linear, Int8Linear
from cadence.kernels.quant_formats import Int4Weight, pack_nibbles, quantize_int8

logger = logging.getLogger(__name__)

GGUF_NATIVE = "gguf"  # the --quantization value that selects this loader
BLOCK = 32
_INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
_INT8_TYPES = (GGMLQuantizationType.Q8_0,)
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
# HF projection suffix -> the GGUF per-layer tensor name part.
_GGUF_PART = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@dataclass(frozen=True)
class RawTensor:
    """One GGUF tensor's type and its bytes as stored, ``uint8 [rows, bytes per row]``."""

    qtype: GGMLQuantizationType
    data: np.ndarray


def open_source_gguf(folder: str) -> tuple[str, dict[str, RawTensor]]:
    """The GGUF file a converted folder was made from, and its tensors (memory-mapped).

    Reads the tensor index the converter saved instead of parsing the GGUF header again.
    ValueError if the folder was not converted from a GGUF, or the file is gone or changed.
    """
    marker = os.path.join(folder, SOURCE_FILE)
    if not os.path.isfile(marker):
        raise ValueError(f"quantization='gguf' needs a GGUF model (a .gguf file); {folder} was not converted from one")
    with open(marker, encoding="utf-8") as f:
        source = json.load(f)
    path = source["gguf_path"]
    if not os.path.isfile(path) or not os.path.basename(os.path.normpath(folder)).endswith(cache_key(path)):
        raise ValueError(f"{folder} was converted from {path}, which is gone or has changed; "
                         "pass the .gguf file again")
    file = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, entry in source["tensors"].items():
        rows, row_bytes = entry["shape"][0], int(np.prod(entry["shape"][1:], dtype=np.int64))
        raw = file[entry["offset"] : entry["offset"] + rows * row_bytes].reshape(rows, row_bytes)
        tensors[name] = RawTensor(GGMLQuantizationType[entry["type"]], raw)
    return path, tensors


# ---------------------------------------------------------------- block decoding


def _blocks(data: np.ndarray, block_bytes: int) -> np.ndarray:
    """GGUF rows ``uint8 [N, K/32 * block_bytes]`` -> ``[N, K/32, block_bytes]``."""
    rows = data.shape[0]
    return np.ascontiguousarray(data).reshape(rows, -1, block_bytes)


def _f16(blocks: np.ndarray, offset: int) -> torch.Tensor:
    """The fp16 field at byte ``offset`` of every block, as a float32 ``[N, K/32]``."""
    return torch.from_numpy(np.ascontiguousarray(blocks[..., offset : offset + 2]).view(np.float16)[..., 0]).float()


def decode_q4(data: np.ndarray, qtype: GGMLQuantizationType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Q4_0/Q4_1 rows -> (codes uint8 [N, K], d [N, K/32], min [N, K/32] or None for Q4_0).

    A block's 16 code bytes hold weights j (low nibble) and j + 16 (high nibble).
    """
    has_min = qtype == GGMLQuantizationType.Q4_1
    header = 4 if has_min else 2
    blocks = _blocks(data, header + BLOCK // 2)
    packed = torch.from_numpy(np.ascontiguousarray(blocks[..., header:]))
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(blocks.shape[0], -1)
    return codes, _f16(blocks, 0), _f16(blocks, 2) if has_min else None


def decode_q8_0(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> (codes int8 [N, K], d [N, K/32])."""
    blocks = _blocks(data, 2 + BLOCK)
    codes = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8)).reshape(blocks.shape[0], -1)
    return codes, _f16(blocks, 0)


def int4_from_gguf(codes: torch.Tensor, d: torch.Tensor, minimum: torch.Tensor | None) -> Int4Weight:
    """Decoded Q4_0/Q4_1 rows (``[N, K]`` codes, ``[N, K/32]`` d/min) -> an ``Int4Weight``, group 32."""
    if minimum is None:  # Q4_0: symmetric around 8, exactly our convention
        return Int4Weight(pack_nibbles(codes.t(), dim=0), d.t().half().contiguous(), None, BLOCK)
    # A block with d == 0 is `min` everywhere, whatever its codes say. Stored as code 9,
    # zero 8, scale min: (9 - 8) * min is exact, and the CPU op's bf16 zero term for it,
    # (8 - zero) * scale, is exactly 0 (scale 1 and zero -min would round a small min away).
    empty = d == 0
    codes = codes.masked_fill(empty.repeat_interleave(BLOCK, dim=1), 9)
    scale = torch.where(empty, minimum, d)
    zero = torch.where(empty, torch.full_like(d, 8.0), -minimum / torch.where(empty, torch.ones_like(d), d))
    return Int4Weight(pack_nibbles(codes.t(), dim=0), scale.t().half().contiguous(), zero.t().contiguous(), BLOCK)


def int8_from_q8_0(codes: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows -> per-channel int8 (qweight [N, K], scale [N] float32), re-quantized once."""
    exact = codes.float() * d.repeat_interleave(BLOCK, dim=1)  # each product is exact in fp32
    return quantize_int8(exact, torch.float32)


# ---------------------------------------------------------------- loading


class GgufNativeLoader:
    """Chooses which fused projections load natively, and builds them from the GGUF file.

    Use: ``install_placeholders`` on the meta model, stream the converted folder's weights
    through ``filter`` into ``load_weights``, then ``finish`` to swap in the quantized layers.
    """

    def __init__(self, folder: str, model: nn.Module, num_heads: int, num_kv_heads: int) -> None:
        self.path, self.tensors = open_source_gguf(folder)
        self.heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}
        self.plan: dict[str, str] = {}  # fused module name -> "int4" | "int8"
        dense: list[str] = []
        for name, module in model.named_modules():
            fused = _fused_suffix(name)
            if fused is None or not isinstance(module, nn.Linear):
                continue
            types = {self._tensor(name, fused, hf).qtype for hf in FUSED_SHARDS[fused]}
            if types <= set(_INT4_TYPES):
                self.plan[name] = "int4"
            elif types <= set(_INT8_TYPES):
                self.plan[name] = "int8"
            else:
                dense.append(f"{name} ({'/'.join(sorted(t.name for t in types))})")
        if dense:
            logger.info("GGUF layers without a native int4/int8 mapping stay dense: %s", ", ".join(dense[:4]))
        self.biases: dict[str, torch.Tensor] = {}  # HF projection name -> bias (already un-permuted)

    def _tensor(self, fused_name: str, fused: str, hf: str) -> RawTensor:
        layer = fused_name.split(".")[-3]  # model.layers.<i>.<self_attn|mlp>.<proj>
        gguf_name = f"blk.{layer}.{_GGUF_PART[hf]}.weight"
        if gguf_name not in self.tensors:
            raise ValueError(f"{os.path.basename(self.path)} has no tensor {gguf_name}")
        return self.tensors[gguf_name]

    def head_tensor(self, tied: bool) -> RawTensor:
        """The file's LM head: its ``output.weight``, or ``token_embd.weight`` when tied."""
        name = "token_embd.weight" if tied else "output.weight"
        if name not in self.tensors:
            raise ValueError(f"{os.path.basename(self.path)} has no tensor {name}")
        return self.tensors[name]

    def head_is_quantized(self, tied: bool) -> bool:
        """Whether the file stores the LM head in quantized blocks (Q8_0, Q6_K, ...)."""
        return self.head_tensor(tied).qtype not in _FLOAT_TYPES

    def head_values(self, tied: bool) -> torch.Tensor:
        """The LM head's exact values as the file's blocks give them, float32 ``[vocab, hidden]``."""
        raw = self.head_tensor(tied)
        return torch.from_numpy(np.asarray(dequantize(raw.data, raw.qtype), dtype=np.float32))

    def install_placeholders(self, model: nn.Module) -> None:
        for name in self.plan:
            module = model.get_submodule(name)
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child,
                    PendingInt4Linear(module.in_features, module.out_features, module.bias is not None))

    def filter(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Drop the dense copies of natively loaded projections; keep their biases aside."""
        for name, tensor in weights:
            projection = projection_of(name)
            if projection is None:
                yield name, tensor
                continue
            module, attr = projection
            prefix, fused, _ = fused_of(module)
            if prefix + fused not in self.plan:
                yield name, tensor
            elif attr == "bias":
                self.biases[module] = tensor

    def finish(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> int:
        """Build and install every planned layer; returns how many were built."""
        for name, kind in self.plan.items():
            fused = _fused_suffix(name)
            assert fused is not None
            prefix = name[: -len(fused)]
            placeholder = model.get_submodule(name)
            shards = [self._shard(name, fused, hf) for hf in FUSED_SHARDS[fused]]
            bias = self._bias(placeholder, [prefix + hf for hf in FUSED_SHARDS[fused]], dtype)
            layer: nn.Module
            if kind == "int4":
                weight = concat_int4(shards)  # type: ignore[arg-type]
                layer = Int4Linear(weight.to(device), None if bias is None else bias.to(device))
            else:
                qweight = torch.cat([q for q, _ in shards])  # type: ignore[misc]
                scale = torch.cat([s for _, s in shards])  # type: ignore[misc]
                layer = Int8Linear(qweight.to(device), scale.to(device), None if bias is None else bias.to(device))
            if (layer.in_features, layer.out_features) != (placeholder.in_features, placeholder.out_features):
                raise ValueError(f"{name}: GGUF gives {layer.in_features}->{layer.out_features}, "
                                 f"the model expects {placeholder.in_features}->{placeholder.out_features}")
            parent, child = name.rsplit(".", 1)
            setattr(model.get_submodule(parent), child, layer)
        return len(self.plan)

    def _shard(self, fused_name: str, fused: str, hf: str) -> Int4Weight | tuple[torch.Tensor, torch.Tensor]:
        tensor = self._tensor(fused_name, fused, hf)
        heads = self.heads.get(hf)
        if tensor.qtype in _INT4_TYPES:
            parts = decode_q4(tensor.data, tensor.qtype)
            if heads is not None:
                parts = tuple(None if p is None else unpermute_rope_rows(p, heads) for p in parts)  # type: ignore[assignment]
            return int4_from_gguf(*parts)
        codes, d = decode_q8_0(tensor.data)
        if heads is not None:
            codes, d = unpermute_rope_rows(codes, heads), unpermute_rope_rows(d, heads)
        return int8_from_q8_0(codes, d)

    def _bias(self, placeholder: PendingInt4Linear, shard_names: list[str], dtype: torch.dtype) -> torch.Tensor | None:
        if not placeholder.has_bias:
            return None
        missing = [n for n in shard_names if n not in self.biases]
        if missing:
            raise ValueError(f"the converted checkpoint is missing biases: {', '.join(missing)}")
        return torch.cat([self.biases.pop(n).to(dtype) for n in shard_names])


def _fused_suffix(name: str) -> str | None:
    """``model.layers.3.mlp.gate_up_proj`` -> ``mlp.gate_up_proj`` (None for other modules)."""
    for fused in FUSED_SHARDS:
        if name.endswith("." + fused):
            return fused
    return None
