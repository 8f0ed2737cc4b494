"""GPTQ over a whole model, layer by layer, on calibration samples (``cadence quantize``).

As in AutoGPTQ and llm-compressor: the calibration tokens run through the model one
decoder layer at a time. Each layer's four projections gather their input Hessians in
one pass, are quantized by ``gptq.py``, and the layer is run again with the quantized
weights, so the next layer calibrates on the activations the quantized model will
really produce. The result is written as a standard 4-bit GPTQ checkpoint that Cadence
(engine/quantization/checkpoint.py), vLLM and transformers load. A tool, not serving:
nothing under ``cadence.engine`` or ``cadence.server``'s serve path imports it.

Calibration text: a file of the user's, or, by default, samples the model draws from
itself at temperature 1 (data-free; nothing to download here). The perplexity the
result scores is measured on separate text (bench/RESULTS.md).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
from collections.abc import Callable

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from cadence.engine.attention.backend import AttentionSpec
from cadence.engine.loader import iterate_weights, load_model
from cadence.engine.model_config import ModelConfig
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.models.weight_names import FUSED_SHARDS
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.engine.quantization.load_time_config import TARGET_LAYERS, group_size_for
from cadence.kernels.formats.quant_formats import Int4Weight, dequantize_int4, to_gptq
from cadence.tools.gptq import DEFAULT_DAMPING, HessianAccumulator, gptq_quantize

logger = logging.getLogger(__name__)

# Files of the source folder that do not describe the quantized one.
_NOT_COPIED = ("gguf_source.json", "model.safetensors.index.json")


class CausalContext:
    """Prefill-only attention for calibration: ``samples`` sequences of equal length."""

    def __init__(self, spec: AttentionSpec, samples: int, length: int) -> None:
        self.spec, self.samples, self.length = spec, samples, length
        self.mask: torch.Tensor | None = None
        if spec.sliding_window is not None:
            pos = torch.arange(length)
            distance = pos[:, None] - pos[None, :]
            self.mask = (distance >= 0) & (distance < spec.sliding_window)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        def batch(t: torch.Tensor) -> torch.Tensor:  # [S*L, H, D] -> [S, H, L, D]
            return t.view(self.samples, self.length, *t.shape[1:]).transpose(1, 2)

        mask = None if self.mask is None else self.mask.to(q.device)
        out = F.scaled_dot_product_attention(
            batch(q), batch(k), batch(v), attn_mask=mask, is_causal=mask is None, scale=self.spec.scale, enable_gqa=True
        )
        return out.transpose(1, 2).reshape(q.shape)


def common_group_size(model: LlamaForCausalLM, requested: int) -> int:
    """One group size for every projection (a GPTQ config has one): the largest power of
    two up to ``requested`` that divides every projection's K. SmolLM2 (K = 576 and
    1,536) gets 64 for a requested 128."""
    sizes = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGET_LAYERS and isinstance(module, LinearLayer):
            g = group_size_for(module.in_features, requested)
            if g is None:
                raise ValueError(f"{name} (K={module.in_features}) has no int4 group size of at least 32")
            sizes.append(g)
    return min(sizes)


@torch.no_grad()
def gptq_model(
    model: LlamaForCausalLM,
    samples: torch.Tensor,
    group_size: int,
    symmetric: bool = True,
    damping: float = DEFAULT_DAMPING,
    chunk: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Int4Weight]:
    """Quantize every decoder projection of our Llama-family ``model`` by GPTQ.

    ``samples`` is ``[S, L]`` token ids. Returns ``{fused module name: Int4Weight}`` and
    leaves the model holding the dequantized weights (the quantized model's function).
    ``chunk`` samples run through a layer at a time.
    """
    s, length = samples.shape
    decoder = model.model
    device = decoder.norm.weight.device
    ids = samples.to(device).reshape(-1)
    positions = torch.arange(length, device=device).repeat(s)
    spec = model.attention_spec()
    rows = chunk * length
    hidden = decoder.embed_tokens(ids)
    residual: torch.Tensor | None = None
    results: dict[str, Int4Weight] = {}
    layers = list(decoder.layers)

    def run(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        outs, resids = [], []
        for start in range(0, s * length, rows):
            stop = min(start + rows, s * length)
            ctx = CausalContext(spec, (stop - start) // length, length)
            r = None if residual is None else residual[start:stop]
            out, res = layer(decoder.rotary.at(positions[start:stop]), hidden[start:stop], r, ctx)
            outs.append(out)
            resids.append(res)
        return torch.cat(outs), torch.cat(resids)

    for index, layer in enumerate(layers):
        projections = {suffix: _projection(layer, suffix) for suffix in FUSED_SHARDS}
        hessians = {suffix: HessianAccumulator(m.in_features, device) for suffix, m in projections.items()}
        hooks = [
            m.register_forward_pre_hook(lambda _m, args, acc=hessians[suffix]: acc.add(args[0]))
            for suffix, m in projections.items()
        ]
        try:
            run(layer)
        finally:
            for hook in hooks:
                hook.remove()
        for suffix, module in projections.items():
            try:
                weight = gptq_quantize(module.weight, hessians[suffix].hessian, group_size, symmetric, damping)
            except torch.linalg.LinAlgError as exc:
                raise ValueError(
                    f"GPTQ of model.layers.{index}.{suffix}: its Hessian is not positive definite "
                    f"even with damping {damping}; raise --damping or calibrate on more text"
                ) from exc
            module.weight.copy_(dequantize_int4(weight, module.weight.dtype))
            results[f"model.layers.{index}.{suffix}"] = weight
        hidden, residual = run(layer)
        if progress is not None:
            progress(index + 1, len(layers))
    return results


def _projection(layer: nn.Module, suffix: str) -> LinearLayer:
    module = layer.get_submodule(suffix)
    assert isinstance(module, LinearLayer), suffix
    return module


def _layer_prefix(name: str) -> str:
    """``model.layers.3.mlp.down_proj`` -> ``model.layers.3``."""
    return name.rsplit(".", 2)[0]


def shard_sizes(config: ModelConfig) -> dict[str, int]:
    """Each HF projection's N (its share of our fused layers' output features)."""
    heads, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    return {
        "self_attn.q_proj": heads,
        "self_attn.k_proj": kv,
        "self_attn.v_proj": kv,
        "self_attn.o_proj": config.hidden_size,
        "mlp.gate_proj": config.intermediate_size,
        "mlp.up_proj": config.intermediate_size,
        "mlp.down_proj": config.hidden_size,
    }


def split_shards(name: str, weight: Int4Weight, sizes: dict[str, int]) -> dict[str, Int4Weight]:
    """A fused ``Int4Weight`` cut along N back into its HF modules, ``sizes`` being each one's N."""
    prefix, suffix = _layer_prefix(name), name.split(".", 3)[3]
    out, start = {}, 0
    for hf in FUSED_SHARDS[suffix]:
        stop = start + sizes[hf]
        zeros = None if weight.zeros is None else weight.zeros[:, start:stop].contiguous()
        out[f"{prefix}.{hf}"] = Int4Weight(
            weight.qweight[:, start:stop].contiguous(),
            weight.scales[:, start:stop].contiguous(),
            zeros,
            weight.group_size,
        )
        start = stop
    return out


def write_gptq_checkpoint(
    source: str,
    out: str,
    dense: dict[str, torch.Tensor],
    quantized: dict[str, Int4Weight],
    shard_sizes: dict[str, int],
    group_size: int,
    symmetric: bool,
    calibration: dict[str, object],
) -> None:
    """The source folder's files and non-projection tensors, plus GPTQ tensors (v1 format)."""
    os.makedirs(out, exist_ok=True)
    for entry in os.listdir(source):
        if entry.endswith(".safetensors") or entry in _NOT_COPIED or not os.path.isfile(os.path.join(source, entry)):
            continue
        shutil.copy(os.path.join(source, entry), os.path.join(out, entry))
    tensors = dict(dense)
    for name, weight in quantized.items():
        for module, shard in split_shards(name, weight, shard_sizes).items():
            tensors.pop(f"{module}.weight", None)
            tensors.update({f"{module}.{k}": v for k, v in to_gptq(shard).items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"] = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": group_size,
        "desc_act": False,
        "sym": symmetric,
        "checkpoint_format": "gptq",
        "damp_percent": calibration.get("damping", DEFAULT_DAMPING),
        "quantizer": "cadence",
        "calibration": calibration,
    }
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)


def self_samples(source: str, count: int, length: int, seed: int, device: str) -> torch.Tensor:
    """``[count, length]`` token ids the model samples itself at temperature 1 from BOS."""
    from cadence import LLM, SamplingParams  # the engine, only for this (not at import)

    llm = LLM(source, dtype="float32", device=device, max_model_len=length, max_num_seqs=max(1, min(count, 64)))
    bos = llm.engine.model_config.bos_token_id
    start = [bos if bos is not None else 0]
    params = [
        SamplingParams(temperature=1.0, seed=seed + i, max_tokens=length - 1, ignore_eos=True) for i in range(count)
    ]
    outputs = llm.generate([{"prompt_token_ids": start}] * count, params)
    samples = torch.tensor([start + list(o.outputs[0].token_ids) for o in outputs], dtype=torch.long)
    # The engine's fp32 copy of the model must be gone before calibration loads another
    # (an 8B model is 32 GB in fp32); its engine holds reference cycles.
    del llm, outputs
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return samples


def text_samples(token_ids: list[int], count: int, length: int) -> torch.Tensor:
    """Up to ``count`` non-overlapping ``length``-token windows of a tokenized text."""
    windows = min(count, len(token_ids) // length)
    if windows == 0:
        raise ValueError(f"the calibration text has {len(token_ids)} tokens, fewer than one sample of {length}")
    if windows < count:
        logger.warning("calibration text gives %d samples of %d tokens, not %d", windows, length, count)
    return torch.tensor(token_ids[: windows * length], dtype=torch.long).view(windows, length)


def quantize_checkpoint(
    source: str,
    out: str,
    group_size: int = 128,
    symmetric: bool = True,
    num_samples: int = 128,
    sample_length: int = 256,
    calibration_file: str | None = None,
    seed: int = 0,
    device: str = "cpu",
    damping: float = DEFAULT_DAMPING,
) -> dict[str, object]:
    """GPTQ a dense HF folder into a 4-bit GPTQ checkpoint at ``out``; returns what was done.

    The model is held in float32 on ``device`` (an 8B model needs about 32 GB there)."""
    if num_samples < 1 or sample_length < 2:
        raise ValueError(
            f"GPTQ needs at least one calibration sample of at least 2 tokens, got {num_samples} x {sample_length}"
        )
    if ModelConfig.from_pretrained(source).quantization is not None:
        raise ValueError(f"{source} is already quantized; GPTQ starts from a dense checkpoint")
    if calibration_file is not None:
        from transformers import AutoTokenizer

        with open(calibration_file, encoding="utf-8") as f:
            text = f.read()
        ids = AutoTokenizer.from_pretrained(source)(text)["input_ids"]
        samples = text_samples(ids, num_samples, sample_length)
    else:
        samples = self_samples(source, num_samples, sample_length, seed, device)
    model, config = load_model(source, torch.float32, device)
    assert isinstance(model, LlamaForCausalLM), "GPTQ calibration runs the Llama-family decoder"
    group = common_group_size(model, group_size)
    logger.info(
        "GPTQ: %d samples of %d tokens, group %d, %s",
        samples.shape[0],
        samples.shape[1],
        group,
        "symmetric" if symmetric else "with zero points",
    )
    quantized = gptq_model(
        model,
        samples,
        group,
        symmetric,
        damping,
        progress=lambda done, total: logger.info("GPTQ: layer %d/%d", done, total),
    )
    calibration = {
        "source": os.path.basename(calibration_file) if calibration_file else "self-generated",
        "samples": int(samples.shape[0]),
        "tokens_per_sample": int(samples.shape[1]),
        "seed": seed,
        "damping": damping,
    }
    # Everything but the projection weights GPTQ replaces (no second copy of those).
    projections = {
        f"{_layer_prefix(name)}.{hf}.weight" for name in quantized for hf in FUSED_SHARDS[name.split(".", 3)[3]]
    }
    dense = {name: t for name, t in iterate_weights(source) if name not in projections}
    write_gptq_checkpoint(source, out, dense, quantized, shard_sizes(config), group, symmetric, calibration)
    return {"group_size": group, "layers": len(quantized), **calibration}
