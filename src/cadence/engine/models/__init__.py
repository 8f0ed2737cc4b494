"""Model registry: maps a checkpoint's architecture name to our implementation."""

from __future__ import annotations

from cadence.engine.model_config import ModelConfig
from cadence.engine.models.causal_lm import CausalLM, ModelClass
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.models.moe import MoEForCausalLM

# All four are the same decoder; the differences (biases, q/k norm, sliding window)
# come from ModelConfig flags.
_REGISTRY: dict[str, ModelClass] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    # The same decoder with MoE feed-forward blocks (engine/models/moe.py).
    "MixtralForCausalLM": MoEForCausalLM,
    "Qwen2MoeForCausalLM": MoEForCausalLM,
    "Qwen3MoeForCausalLM": MoEForCausalLM,
}


def get_model_class(config: ModelConfig) -> ModelClass:
    """The model class for `config.architecture`; ValueError if unsupported."""
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: {sorted(_REGISTRY)}") from None


__all__ = ["CausalLM", "LlamaForCausalLM", "MoEForCausalLM", "ModelClass", "get_model_class"]
