"""Model registry: maps a checkpoint's architecture name to our implementation."""
from __future__ import annotations

from torch import nn

from cadence.engine.model_config import ModelConfig
from cadence.engine.models.llama import LlamaForCausalLM

# All four are the same decoder; the differences (biases, q/k norm, sliding window)
# come from ModelConfig flags.
_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    """The model class for `config.architecture`; ValueError if unsupported."""
    try:
        return _REGISTRY[config.architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {config.architecture!r}; supported: {sorted(_REGISTRY)}"
        ) from None


__all__ = ["LlamaForCausalLM", "get_model_class"]
