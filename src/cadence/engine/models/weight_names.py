"""How checkpoint (Hugging Face) module names map onto our fused projections.

The one copy of this map: the model's ``load_weights``, the GPTQ/AWQ and GGUF loaders and
``cadence quantize`` all read it. q/k/v become one ``qkv_proj`` and gate/up one
``gate_up_proj``, each shard a block of rows in that order along N.
"""

from __future__ import annotations

# Our projection (suffix of its module name) -> the checkpoint modules it holds, in N order.
FUSED_SHARDS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}
# Checkpoint module suffix -> (our projection suffix, shard index).
SHARD_OF: dict[str, tuple[str, int]] = {
    hf: (fused, index) for fused, shards in FUSED_SHARDS.items() for index, hf in enumerate(shards)
}
LM_HEAD = "lm_head"


def fused_target(module: str) -> tuple[str, int] | None:
    """``model.layers.3.self_attn.k_proj`` -> (``model.layers.3.self_attn.qkv_proj``, 1);
    None for a module outside the decoder projections."""
    for hf, (fused, index) in SHARD_OF.items():
        if module.endswith("." + hf):
            return module[: -len(hf)] + fused, index
    return None


def fused_suffix(module: str) -> str | None:
    """``model.layers.3.mlp.gate_up_proj`` -> ``mlp.gate_up_proj`` (None for other modules)."""
    return next((fused for fused in FUSED_SHARDS if module.endswith("." + fused)), None)


# MoE: an expert's (or Qwen2-MoE's shared expert's) checkpoint module -> (our projection,
# shard). Qwen names them as a dense MLP does; Mixtral's w1/w3/w2 are gate/up/down.
EXPERT_SHARDS: dict[str, tuple[str, int]] = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
    "w1": ("gate_up_proj", 0),
    "w3": ("gate_up_proj", 1),
    "w2": ("down_proj", 0),
}
# Mixtral's name for a layer's feed-forward block; ours is ``mlp``, as Qwen's.
MIXTRAL_MOE = ".block_sparse_moe."


def expert_target(module: str) -> tuple[str, int] | None:
    """``model.layers.3.mlp.experts.5.w3`` -> (``model.layers.3.mlp.experts.5.gate_up_proj``, 1),
    ``...mlp.shared_expert.down_proj`` -> (``...mlp.shared_expert.down_proj``, 0); None for
    a module outside an expert."""
    parent, _, leaf = module.rpartition(".")
    if leaf not in EXPERT_SHARDS:
        return None
    grandparent, _, index = parent.rpartition(".")
    if not (parent.endswith(".shared_expert") or (index.isdigit() and grandparent.endswith(".experts"))):
        return None
    fused, shard = EXPERT_SHARDS[leaf]
    return f"{parent}.{fused}", shard


def ours_from_mixtral(name: str) -> str:
    """``model.layers.0.block_sparse_moe.gate.weight`` -> ``model.layers.0.mlp.gate.weight``."""
    return name.replace(MIXTRAL_MOE, ".mlp.", 1)
