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
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from cadence.engine.gguf_loader import (
    HF_TO_GGUF,
    SOURCE_FILE,
    cache_key,
    unpermute_rope_rows,
)
from cadence.engine.models.weight_names import FUSED_SHARDS, fused_suffix
from cadence.engine.quantization.checkpoint import concat_int4
from cadence.engine.quantization.linear import Int4Method, Int8Method
from cadence.engine.quantization.linear_layer import (
    DenseMethod,
    LinearLayer,
    QuantConfig,
    QuantMethod,
)
from cadence.kernels.formats.quant_formats import Int4Weight, pack_nibbles, quantize_int8

logger = logging.getLogger(__name__)

GGUF_NATIVE = "gguf"  # the --quantization value that selects this loader
BLOCK = 32
_INT4_TYPES = (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1)
_INT8_TYPES = (GGMLQuantizationType.Q8_0,)
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


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
        raise ValueError(f"{folder} was converted from {path}, which is gone or has changed; pass the .gguf file again")
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


class GgufSource:
    """The GGUF file a converted folder came from: its projections' shards, decoded from
    their blocks (Q/K rows un-permuted), and its LM head."""

    def __init__(self, folder: str, num_heads: int, num_kv_heads: int) -> None:
        self.path, self.tensors = open_source_gguf(folder)
        self.heads = {"self_attn.q_proj": num_heads, "self_attn.k_proj": num_kv_heads}

    def tensor(self, prefix: str, hf: str) -> RawTensor:
        """The raw tensor of checkpoint module ``hf`` (``self_attn.q_proj``) in decoder layer ``prefix``."""
        layer = prefix.split(".")[2]  # model.layers.<i>.<self_attn|mlp>.<proj>
        name = f"blk.{layer}.{HF_TO_GGUF[hf]}.weight"
        if name not in self.tensors:
            raise ValueError(f"{os.path.basename(self.path)} has no tensor {name}")
        return self.tensors[name]

    def shards(self, layer: LinearLayer) -> list[tuple[str, RawTensor]]:
        """(checkpoint module suffix, raw tensor) of each of ``layer``'s shards, in N order."""
        fused = fused_suffix(layer.prefix)
        assert fused is not None, layer.prefix
        return [(hf, self.tensor(layer.prefix, hf)) for hf in FUSED_SHARDS[fused]]

    def int4_shard(self, hf: str, tensor: RawTensor) -> Int4Weight:
        codes, d, minimum = decode_q4(tensor.data, tensor.qtype)
        heads = self.heads.get(hf)
        if heads is not None:
            codes, d = unpermute_rope_rows(codes, heads), unpermute_rope_rows(d, heads)
            minimum = None if minimum is None else unpermute_rope_rows(minimum, heads)
        return int4_from_gguf(codes, d, minimum)

    def int8_shard(self, hf: str, tensor: RawTensor) -> tuple[torch.Tensor, torch.Tensor]:
        codes, d = decode_q8_0(tensor.data)
        heads = self.heads.get(hf)
        if heads is not None:
            codes, d = unpermute_rope_rows(codes, heads), unpermute_rope_rows(d, heads)
        return int8_from_q8_0(codes, d)

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


class _FromFile(QuantMethod):
    """Loading for a projection whose weight comes from the GGUF file: the converted
    folder's dense copy in the stream is skipped; only the bias loads from it."""

    def create_weights(
        self,
        layer: LinearLayer,
        input_size: int,
        output_sizes: list[int],
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None:
        pass

    def load_weights(self, layer: LinearLayer, shard: int, name: str, tensor: torch.Tensor) -> None:
        if name != "weight":
            QuantMethod.load_weights(self, layer, shard, name, tensor)

    def expected_tensors(self, layer: LinearLayer) -> tuple[str, ...]:
        return QuantMethod.expected_tensors(self, layer)


class GgufInt4Method(_FromFile, Int4Method):
    """Q4_0/Q4_1 shards straight into the int4 layout (group 32), joined along N."""

    def __init__(self, source: GgufSource, device: torch.device) -> None:
        super().__init__(BLOCK, symmetric=False)
        self.source, self.device = source, device

    def process_after_loading(self, layer: LinearLayer) -> None:
        weight = concat_int4([self.source.int4_shard(hf, raw) for hf, raw in self.source.shards(layer)])
        self.install(layer, weight.to(self.device))


class GgufInt8Method(_FromFile, Int8Method):
    """Q8_0 shards re-quantized per output channel into the int8 layout, joined along N."""

    def __init__(self, source: GgufSource, device: torch.device) -> None:
        self.source, self.device = source, device

    def process_after_loading(self, layer: LinearLayer) -> None:
        shards = [self.source.int8_shard(hf, raw) for hf, raw in self.source.shards(layer)]
        qweight, scale = torch.cat([q for q, _ in shards]), torch.cat([s for _, s in shards])
        self.install(layer, qweight.to(self.device), scale.to(self.device))


class GgufNativeConfig(QuantConfig):
    """``quantization="gguf"``: each fused projection whose shards are all Q4_0/Q4_1 (or
    all Q8_0) in the file reads them from there; any other stays dense from the folder."""

    def __init__(self, folder: str, num_heads: int, num_kv_heads: int, device: torch.device) -> None:
        self.source = GgufSource(folder, num_heads, num_kv_heads)
        self.device = device
        self.kept_dense: list[str] = []

    def linear_method(self, prefix: str, shard_names: tuple[str, ...], input_size: int) -> QuantMethod:
        fused = fused_suffix(prefix)
        assert fused is not None, prefix
        types = {self.source.tensor(prefix, hf).qtype for hf in FUSED_SHARDS[fused]}
        if types <= set(_INT4_TYPES):
            return GgufInt4Method(self.source, self.device)
        if types <= set(_INT8_TYPES):
            return GgufInt8Method(self.source, self.device)
        self.kept_dense.append(f"{prefix} ({'/'.join(sorted(t.name for t in types))})")
        if len(self.kept_dense) == 1:
            logger.info("GGUF layers without a native int4/int8 mapping stay dense, such as %s", self.kept_dense[0])
        return DenseMethod()
