"""Build a model from a Hugging Face folder and stream its safetensors weights into it."""
from __future__ import annotations

import glob
import json
import os
from typing import Iterator

import torch
from safetensors import safe_open
from torch import nn

from cadence.engine.model_config import ModelConfig
from cadence.engine.models import get_model_class
from cadence.engine.quantization import quantize_model, validate_quantization
from cadence.engine.quantization.checkpoint import CheckpointQuantizer, install_placeholders
from cadence.engine.quantization.gguf_native import GGUF_NATIVE, GgufNativeLoader
from cadence.engine.quantization.lm_head import install_int8_lm_head

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def resolve_dtype(
    name: str | torch.dtype, config: ModelConfig, device: torch.device | str
) -> torch.dtype:
    """Turn a user dtype choice into a torch dtype.

    "auto" means the checkpoint's dtype, except for half precision on CPU: bfloat16
    where the CPU has AMX or AVX512-BF16 (there bf16 matmuls are 3.5-6x fp32 at batch
    16 and more, and level at batch 1; bench/RESULTS.md), float32 elsewhere (fp16/bf16
    matmuls are much slower than fp32 without that hardware). A float32 checkpoint
    stays float32: "auto" never lowers precision the checkpoint has.
    """
    if isinstance(name, torch.dtype):
        return name
    key = name.lower().removeprefix("torch.")
    if key != "auto":
        if key not in _DTYPES:
            raise ValueError(f"unknown dtype {name!r}; use auto, float32, float16 or bfloat16")
        return _DTYPES[key]
    stored = (config.torch_dtype or "float32").lower().removeprefix("torch.")
    dtype = _DTYPES.get(stored, torch.float32)
    if torch.device(device).type == "cpu" and dtype in (torch.float16, torch.bfloat16):
        from cadence.engine.quantization.cpu_policy import has_fast_bf16

        return torch.bfloat16 if has_fast_bf16() else torch.float32
    return dtype


def safetensors_files(path: str) -> list[str]:
    """The checkpoint's .safetensors files: single file, sharded index, or any present."""
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        return [os.path.join(path, shard) for shard in sorted(set(weight_map.values()))]
    found = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    return found


def checkpoint_names(path: str) -> list[str]:
    """Every tensor name in the checkpoint, from the safetensors headers only (cheap)."""
    names: list[str] = []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.extend(f.keys())
    return names


def iterate_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, so peak memory stays near one tensor."""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    quantize_lm_head: bool | None = None,
) -> tuple[nn.Module, ModelConfig]:
    """Read config, build the model with uninitialised storage on `device`, load weights.

    Returns the model in eval mode (with grads off) and its ModelConfig. Weights are
    cast to `dtype` as they are copied in. `quantization` ("int8", "int4" or "fp8") then
    swaps the decoder's projections for quantized layers, one at a time, so the peak is
    the dense model in `dtype` and the steady state is the quantized one.

    A pre-quantized checkpoint (GPTQ/AWQ int4, detected from `quantization_config` in
    config.json) loads natively: its decoder projections become Int4Linear layers built
    straight from the packed tensors (engine/quantization/checkpoint.py), with no dense
    copy; `quantization` must then be None.

    `quantization="gguf"` on a folder converted from a GGUF file reads the decoder
    projections' Q4_0/Q4_1/Q8_0 blocks from that file into Int4Linear/Int8Linear layers
    (engine/quantization/gguf_native.py); the folder's dense copies of those layers are
    read from the safetensors stream and dropped.

    `quantize_lm_head` stores the LM head (and a tied embedding) as int8 per vocabulary
    row (engine/quantization/lm_head.py), with any `quantization` or none. None means:
    only under "gguf", and only when the file stores the head quantized.
    """
    quantization = validate_quantization(quantization)
    path = os.fspath(path)
    native_gguf = quantization == GGUF_NATIVE
    config = ModelConfig.from_pretrained(path)
    cls = get_model_class(config)
    device = torch.device(device)
    # Building on meta skips the random initialisation of every weight; to_empty then
    # allocates real (uninitialised) storage that load_weights overwrites in full.
    with torch.device("meta"):
        model = cls(config)
        prequantized = config.quantization
        if prequantized is not None:
            if quantization is not None:
                raise ValueError(
                    f"{path} is already quantized ({prequantized.describe()}); "
                    f"quantization={quantization!r} cannot be applied on top, leave it unset"
                )
            install_placeholders(model, prequantized.lm_head)
        gguf = GgufNativeLoader(path, model, config.num_attention_heads, config.num_key_value_heads) if native_gguf else None
        if gguf is not None:
            gguf.install_placeholders(model)
    model = model.to(dtype=dtype).to_empty(device=device)
    if gguf is not None:
        model.load_weights(gguf.filter(iterate_weights(path)))  # type: ignore[operator]
        gguf.finish(model, dtype, device)
    elif prequantized is None:
        model.load_weights(iterate_weights(path))  # type: ignore[operator]
    else:
        quantizer = CheckpointQuantizer(model, prequantized, checkpoint_names(path), dtype, device)
        model.load_weights(quantizer.filter(iterate_weights(path)))  # type: ignore[operator]
        quantizer.finish()
    model.eval()
    model.requires_grad_(False)
    if quantization is not None and not native_gguf:
        quantize_model(model, quantization)
    tied = getattr(model, "lm_head", None) is None
    file_head_quantized = gguf is not None and gguf.head_is_quantized(tied)
    int8_head = file_head_quantized if quantize_lm_head is None else quantize_lm_head
    if int8_head:
        install_int8_lm_head(model, gguf.head_values(tied) if file_head_quantized else None)  # type: ignore[union-attr]
    if device.type == "cuda":
        # Hand back what loading and quantizing freed: the caching allocator would keep it,
        # and the KV cache is sized from the memory the device reports free.
        torch.cuda.empty_cache()
    return model, config
