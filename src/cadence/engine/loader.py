"""Build a model from a Hugging Face folder and stream its safetensors weights into it."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from functools import partial

import torch
from safetensors import safe_open

from cadence.engine.experts.builder import ExpertOffloadBuilder
from cadence.engine.experts.options import ExpertOffloadOptions
from cadence.engine.model_config import ModelConfig
from cadence.engine.models import get_model_class
from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.quantization.checkpoint import CheckpointConfig
from cadence.engine.quantization.cpu_planner import plan_cpu_kernels
from cadence.engine.quantization.dense_dot import hold_bf16_dot, stage_bf16
from cadence.engine.quantization.gguf_native import GGUF_NATIVE, GgufNativeConfig
from cadence.engine.quantization.linear_layer import DenseConfig, LinearLayer, QuantConfig
from cadence.engine.quantization.lm_head import Int8HeadMethod
from cadence.engine.quantization.load_time_config import LoadTimeConfig, validate_quantization


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


def iterate_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) one tensor at a time, so peak memory stays near one tensor."""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def checkpoint_tensor_names(path: str) -> frozenset[str]:
    """Every tensor name in the checkpoint, from the safetensors headers (no tensor is read)."""
    names: set[str] = set()
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            names.update(f.keys())
    return frozenset(names)


def quant_config_for(
    path: str, config: ModelConfig, quantization: str | None, quantize_lm_head: bool | None, device: torch.device
) -> QuantConfig:
    """The ``QuantConfig`` that gives each projection (and the head) its method.

    A pre-quantized checkpoint's own format wins (``quantization`` must then be None);
    "gguf" reads a GGUF's blocks; "int8"/"int4"/"fp8" quantize a dense checkpoint as it
    loads. ``quantize_lm_head`` None means an int8 head only under "gguf", and only when
    the file stores the head quantized (then re-quantized from the file's block values).
    """
    prequantized = config.quantization
    quant: QuantConfig
    if prequantized is not None:
        if quantization is not None:
            raise ValueError(
                f"{path} is already quantized ({prequantized.describe()}); "
                f"quantization={quantization!r} cannot be applied on top, leave it unset"
            )
        quant = CheckpointConfig(prequantized, device, checkpoint_tensor_names(path))
        if quantize_lm_head and quant.lm_head is not None:
            raise ValueError(
                "the LM head is already quantized (the checkpoint's int4 head); "
                "--quantize-lm-head applies to a dense head"
            )
    elif quantization == GGUF_NATIVE:
        quant = GgufNativeConfig(path, config.num_attention_heads, config.num_key_value_heads, device)
    elif quantization is not None:
        quant = LoadTimeConfig(quantization)
    else:
        quant = DenseConfig()
    if quant.lm_head is None:
        tied = config.tie_word_embeddings
        file_head = (
            quant.source if isinstance(quant, GgufNativeConfig) and quant.source.head_is_quantized(tied) else None
        )
        if quantize_lm_head or (quantize_lm_head is None and file_head is not None):
            quant.lm_head = Int8HeadMethod(None if file_head is None else partial(file_head.head_values, tied))
    return quant


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    quantization: str | None = None,
    quantize_lm_head: bool | None = None,
    cpu_kernels: str = "auto",
    expert_offload: ExpertOffloadOptions | None = None,
    bf16_dot_linears: bool = False,
) -> tuple[CausalLM, ModelConfig]:
    """Read config, build the model with uninitialised storage on `device`, load weights.

    Returns the model in eval mode (with grads off) and its ModelConfig. Each projection's
    weight format is its ``QuantMethod``, chosen while the model is built
    (``quant_config_for``): dense weights are cast to `dtype` as they are copied in;
    `quantization` "int8", "int4" or "fp8" quantizes them once loading ends, one layer at
    a time, so the peak is the dense model in `dtype` and the steady state the quantized one.

    A pre-quantized checkpoint (GPTQ/AWQ int4, detected from `quantization_config` in
    config.json) loads natively: its packed tensors become int4 layers with no dense copy
    (engine/quantization/checkpoint.py); `quantization` must then be None.

    `quantization="gguf"` on a folder converted from a GGUF file reads the decoder
    projections' Q4_0/Q4_1/Q8_0 blocks from that file (engine/quantization/gguf_native.py);
    the folder's dense copies of those layers are skipped as they stream past.

    `quantize_lm_head` stores the LM head (and a tied embedding) as int8 per vocabulary
    row (engine/quantization/lm_head.py), with any `quantization` or none. None means:
    only under "gguf", and only when the file stores the head quantized.

    On CPU, `cpu_kernels` says which kernel quantized layers run
    (engine/quantization/cpu_planner.py; "auto" chooses by rule), and `bf16_dot_linears`
    (the bf16 precision, engine/precision.py) loads dense layers in bf16 and runs them on
    bf16dot (engine/quantization/dense_dot.py), with activations in `dtype`.

    `expert_offload` keeps a mixture-of-experts model's routed experts in host memory or
    on disk, with a few slots per layer in fast memory (engine/experts/); no expert is
    ever allocated on `device` beyond those slots.
    """
    quantization = validate_quantization(quantization)
    path = os.fspath(path)
    config = ModelConfig.from_pretrained(path)
    cls = get_model_class(config)
    device = torch.device(device)
    quant = quant_config_for(path, config, quantization, quantize_lm_head, device)
    # Building on meta skips the random initialisation of every weight; to_empty then
    # allocates real (uninitialised) storage that load_weights overwrites in full. Packed
    # weights are only created after loading, so the cast to `dtype` never touches them.
    with torch.device("meta"):
        model = cls(config, quant)
    offload = None
    if expert_offload is not None and expert_offload.enabled:
        offload = ExpertOffloadBuilder(expert_offload, config, device, dtype)
        offload.prepare(model)
    model = model.to(dtype=dtype)
    bf16_dot_linears = bf16_dot_linears and device.type == "cpu"
    if bf16_dot_linears:
        stage_bf16(model)
    model = model.to_empty(device=device)
    if offload is None:
        model.load_weights(iterate_weights(path))
    else:
        model.load_weights(offload.weights(safetensors_files(path), iterate_weights(path)))
        offload.finish(model)
    for module in model.modules():
        if isinstance(module, LinearLayer):
            module.process_after_loading()
    model.eval()
    model.requires_grad_(False)
    if bf16_dot_linears:
        hold_bf16_dot(model)
    if device.type == "cpu":
        plan_cpu_kernels(model.modules(), dtype, cpu_kernels)
    if device.type == "cuda":
        # Hand back what loading and quantizing freed: the caching allocator would keep it,
        # and the KV cache is sized from the memory the device reports free.
        torch.cuda.empty_cache()
    return model, config
