"""Tiny random Hugging Face checkpoints for tests.

`make_tiny_model(kind, path)` builds a seeded random transformers model and saves it
as safetensors into `path`. Random tiny models have nearly flat logits, which makes
greedy decoding flip on 1e-6 float noise; we use a large initializer_range and put
noise on every norm weight and bias so that (a) logits are peaked enough for greedy
outputs to compare robustly across implementations and (b) a mis-mapped norm or bias
weight actually changes the output instead of hiding behind ones/zeros.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

KINDS = ("llama", "llama3_rope", "llama_bias", "qwen2", "qwen3", "tied", "mistral")
# Mixture-of-experts kinds (engine/models/moe.py), kept apart from KINDS: their tests are
# tests/engine/test_moe_models.py.
MOE_KINDS = ("mixtral", "qwen2_moe", "qwen3_moe")

_COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def _llama(**overrides: Any) -> PreTrainedModel:
    return LlamaForCausalLM(LlamaConfig(**{**_COMMON, **overrides}))


_BUILDERS: dict[str, Callable[[], PreTrainedModel]] = {
    "llama": lambda: _llama(num_hidden_layers=3),
    # Llama 3.1-style frequency scaling; original length is below max so it matters.
    "llama3_rope": lambda: _llama(
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    # Llama's attention_bias biases q, k, v and o; mlp_bias biases the MLP.
    "llama_bias": lambda: _llama(attention_bias=True, mlp_bias=True),
    # SmolLM2-style: lm_head shares the embedding matrix.
    "tied": lambda: _llama(tie_word_embeddings=True, num_key_value_heads=1),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**_COMMON)),
    # head_dim deliberately != hidden/heads, as in real Qwen3 checkpoints.
    "qwen3": lambda: Qwen3ForCausalLM(Qwen3Config(**{**_COMMON, "head_dim": 32})),
    # Every layer slides over the last 8 positions.
    "mistral": lambda: MistralForCausalLM(MistralConfig(**{**_COMMON, "sliding_window": 8})),
    # 8 experts of intermediate_size, top-2, always renormalised.
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**_COMMON, num_local_experts=8, num_experts_per_tok=2)),
    # Layer 0 dense (decoder_sparse_step=2), layer 1 sparse with the gated shared expert;
    # top-2 weights not renormalised.
    "qwen2_moe": lambda: Qwen2MoeForCausalLM(
        Qwen2MoeConfig(
            **_COMMON,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            decoder_sparse_step=2,
            norm_topk_prob=False,
        )
    ),
    # Every layer sparse, q/k norm, renormalised top-2 of 4.
    "qwen3_moe": lambda: Qwen3MoeForCausalLM(
        Qwen3MoeConfig(
            **{**_COMMON, "head_dim": 32},
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
        )
    ),
}


@torch.no_grad()
def _perturb(model: PreTrainedModel, gen: torch.Generator) -> None:
    """Make norm weights non-unit and biases non-zero so loading mistakes show up."""
    for name, param in model.named_parameters():
        if "norm" in name:
            param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            if name == "model.norm.weight":
                param.mul_(4.0)  # sharpen logits (std ~10) so greedy choices are stable
        elif name.endswith(".bias"):
            param.copy_(0.2 * torch.randn(param.shape, generator=gen))


def build_tiny_model(kind: str, seed: int = 0) -> PreTrainedModel:
    """A seeded random float32 transformers model of the given kind (in eval mode)."""
    if kind not in _BUILDERS:
        raise ValueError(f"unknown tiny model kind {kind!r}; choose from {KINDS + MOE_KINDS}")
    torch.manual_seed(seed)
    model = _BUILDERS[kind]()
    _perturb(model, torch.Generator().manual_seed(seed + 1))
    return model.eval()


def make_tiny_model(kind: str, path: str | os.PathLike[str], seed: int = 0) -> str:
    """Build a tiny model and save it (config.json + model.safetensors) into `path`."""
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    build_tiny_model(kind, seed).save_pretrained(path, safe_serialization=True)
    return path
