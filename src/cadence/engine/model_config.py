"""The model facts Cadence needs, read straight from a Hugging Face folder's config.json.

We parse the raw JSON rather than going through `AutoConfig` so that loading does not
depend on which transformers version wrote (or reads) the file; both the v4 layout
(`rope_theta` + `rope_scaling`) and the v5 layout (`rope_parameters`) are accepted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
)
# Architectures whose feed-forward blocks are (some or all) mixtures of experts.
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


def _int_list(value: Any) -> list[int]:
    """eos_token_id may be absent, an int, or a list of ints."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value]
    return [int(value)]


def _parse_rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Return (rope_theta, rope_scaling); rope_scaling is None for plain RoPE.

    The scaling dict is normalised so its type is always under "rope_type".
    """
    params = raw.get("rope_parameters")
    if params and any(isinstance(v, dict) for v in params.values()):
        # Per-layer-type RoPE (Gemma-style); none of the supported architectures use it.
        raise ValueError("per-layer-type rope_parameters are not supported")
    scaling: dict[str, Any] = dict(params or raw.get("rope_scaling") or {})
    theta = scaling.pop("rope_theta", None)
    if theta is None:
        theta = raw.get("rope_theta", 10000.0)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    prf = scaling.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if prf is not None and float(prf) != 1.0:
        raise ValueError(f"partial_rotary_factor={prf} is not supported")
    if rope_type == "default":
        return float(theta), None
    scaling["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in scaling:
        # Same fallback transformers uses: the pretraining length is the configured one.
        scaling["original_max_position_embeddings"] = raw.get(
            "original_max_position_embeddings", raw.get("max_position_embeddings")
        )
    return float(theta), scaling


def _parse_sliding_window(raw: dict[str, Any], arch: str, num_layers: int) -> int | None:
    """The attention window when it is really in force on every layer, else None.

    Qwen2/3 keep a `sliding_window` value even when `use_sliding_window` is false, and
    only layers >= max_window_layers slide; Mistral slides on every layer when set.
    A model where only some layers slide cannot be described by one AttentionSpec.
    """
    window = raw.get("sliding_window")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return int(window) if window else None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        if not raw.get("use_sliding_window", False) or not window:
            return None
        layer_types = raw.get("layer_types")
        if layer_types is None:
            first = raw.get("max_window_layers", num_layers)
            layer_types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        kinds = set(layer_types)
        if kinds == {"full_attention"}:
            return None
        if kinds == {"sliding_attention"}:
            return int(window)
        raise ValueError("models that mix sliding and full attention layers are not supported")
    # Llama configs carry no sliding window.
    return None


@dataclass
class MoEConfig:
    """How a mixture-of-experts model routes: ``num_experts_per_tok`` of ``num_experts``
    SwiGLU experts of ``intermediate_size`` per token, from an fp32 softmax over the
    router's logits, renormalised over the kept experts when ``renormalize``."""

    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    renormalize: bool  # Mixtral always; Qwen2/3-MoE when norm_topk_prob
    # Mixtral multiplies expert outputs by the fp32 routing weights; Qwen rounds them to
    # the model's dtype first.
    weights_in_fp32: bool
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE's sigmoid-gated shared expert; 0: none
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` has experts (else it keeps the dense MLP)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def _parse_moe(raw: dict[str, Any], arch: str) -> MoEConfig | None:
    """The MoE settings of the MoE architectures, as their transformers configs read them."""
    if arch not in MOE_ARCHITECTURES:
        return None
    experts = raw.get("num_local_experts") or raw.get("num_experts")  # v5 writes Qwen3-MoE's as the former
    if not experts:
        raise ValueError(f"{arch} config has no num_local_experts / num_experts")
    if arch == "MixtralForCausalLM":
        return MoEConfig(
            num_experts=int(experts),
            num_experts_per_tok=int(raw.get("num_experts_per_tok", 2)),
            intermediate_size=int(raw["intermediate_size"]),
            renormalize=True,
            weights_in_fp32=True,
        )
    return MoEConfig(
        num_experts=int(experts),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 4 if arch == "Qwen2MoeForCausalLM" else 8)),
        intermediate_size=int(raw["moe_intermediate_size"]),
        renormalize=bool(raw.get("norm_topk_prob", False)),
        weights_in_fp32=False,
        shared_expert_intermediate_size=(
            int(raw.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        ),
        decoder_sparse_step=int(raw.get("decoder_sparse_step") or 1),
        mlp_only_layers=[int(i) for i in raw.get("mlp_only_layers") or []],
    )


@dataclass
class ModelConfig:
    """Architecture hyperparameters of a decoder-only causal LM."""

    architectures: list[str]
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections
    o_bias: bool  # bias on the output projection
    mlp_bias: bool
    qk_norm: bool  # Qwen3: per-head RMSNorm on q and k before RoPE
    sliding_window: int | None
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None  # e.g. "bfloat16", as stored in the checkpoint
    # Pre-quantized checkpoint format (GPTQ/AWQ int4) from `quantization_config`, or None
    # for a dense checkpoint. A `CheckpointQuantization` (engine/quantization/checkpoint.py).
    quantization: Any = None
    moe: MoEConfig | None = None  # the routing of an MoE architecture; None for a dense model

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        archs = list(raw.get("architectures") or [])
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or '(none given)'}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or hidden // heads)
        num_layers = int(raw["num_hidden_layers"])
        rope_theta, rope_scaling = _parse_rope(raw)
        if arch == "Qwen2ForCausalLM":
            # Qwen2 hard-codes biased q/k/v and an unbiased o_proj.
            qkv_bias, o_bias = True, False
        elif arch == "Qwen2MoeForCausalLM":
            qkv_bias, o_bias = bool(raw.get("qkv_bias", True)), False
        else:
            qkv_bias = o_bias = bool(raw.get("attention_bias", False))
        # Imported here: the quantization package pulls in torch, which config parsing
        # itself does not need.
        from cadence.engine.quantization.checkpoint import parse_quantization_config

        quantization = parse_quantization_config(raw.get("quantization_config"))
        bos = raw.get("bos_token_id")
        if isinstance(bos, list):
            bos = bos[0] if bos else None
        return cls(
            architectures=[arch],
            model_type=str(raw.get("model_type", "")),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=num_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            sliding_window=_parse_sliding_window(raw, arch, num_layers),
            eos_token_id=_int_list(raw.get("eos_token_id")),
            bos_token_id=None if bos is None else int(bos),
            torch_dtype=raw.get("dtype") or raw.get("torch_dtype"),
            quantization=quantization,
            moe=_parse_moe(raw, arch),
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str]) -> ModelConfig:
        """Read `<path>/config.json`."""
        config_path = os.path.join(os.fspath(path), "config.json")
        if not os.path.isfile(config_path):
            raise FileNotFoundError(f"no config.json in {path}")
        with open(config_path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))
