"""What two engines must agree on before one reads the other's KV blocks."""

from __future__ import annotations

import hashlib
import os
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KVLayout:
    """The shape and meaning of one engine's KV blocks.

    `model` names the weights (their digest), since KV from other weights of the same
    shape would decode into fluent nonsense; the rest fixes how each block's bytes lie.
    """

    model: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the values' storage dtype
    kv_cache_dtype: str  # "auto", "int8" or "fp8" (the latter two carry per-slot scales)
    quantization: str = "none"  # weights quantized at load compute other KV from the same checkpoint
    precision: str = ""  # the arithmetic (engine/precision.py): bf16 linears compute other KV than fp32

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token takes over all layers (keys and values, and scales)."""
        if self.kv_cache_dtype == "auto":
            per_value = {"float32": 4}.get(self.dtype, 2)
            return 2 * self.num_layers * self.num_kv_heads * self.head_dim * per_value
        return 2 * self.num_layers * self.num_kv_heads * (self.head_dim + 4)  # one byte each, a float32 scale

    def mismatch(self, other: KVLayout) -> str | None:
        """Why blocks laid out as `other` cannot be read into this layout, or None."""
        ours, theirs = asdict(self), asdict(other)
        differences = [f"{name} {theirs[name]!r} != {ours[name]!r}" for name in ours if ours[name] != theirs[name]]
        if not differences:
            return None
        return "the KV layouts differ (source vs. here): " + ", ".join(differences)


_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
_SAMPLES_PER_FILE = 16
_SAMPLE_BYTES = 1 << 16


def weights_digest(model_path: str) -> str:
    """A digest that tells checkpoints apart without reading them whole: config.json, and
    per weight file its name, size and 16 evenly spaced 64 KiB samples. Two fine-tunes of
    one base differ in nearly every sample, so they never pass for each other."""
    digest = hashlib.sha256()
    names = sorted(os.listdir(model_path))
    for name in names:
        path = os.path.join(model_path, name)
        if name == "config.json":
            with open(path, "rb") as f:
                digest.update(f.read())
        elif name.endswith(_WEIGHT_SUFFIXES) and os.path.isfile(path):
            size = os.path.getsize(path)
            digest.update(f"{name}:{size}".encode())
            with open(path, "rb") as f:
                for index in range(_SAMPLES_PER_FILE):
                    f.seek(size * index // _SAMPLES_PER_FILE)
                    digest.update(f.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:32]
