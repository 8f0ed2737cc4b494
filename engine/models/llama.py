"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), SmolLM2.

Works on a flattened varlen batch: `input_ids` and `positions` are [T] with tokens from
many sequences back to back; only attention (behind `AttentionContext`) mixes tokens.
q/k/v and gate/up are each one fused Linear, so every layer runs three big GEMMs plus
the output projection instead of seven small ones.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cadence.engine.attention.backend import AttentionContext, AttentionSpec
from cadence.engine.model_config import ModelConfig
from cadence.engine.models.fused_ops import rms_norm, silu_and_mul
from cadence.engine.models.rotary import PositionedRotary, RotaryEmbedding


class RMSNorm(nn.Module):
    """RMSNorm computed in float32, then cast back before the weight, as transformers does.

    Called with a residual, it first adds it (``x + residual`` becomes the next residual),
    as one kernel on a GPU.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    """Self-attention with fused qkv projection and RoPE; the cache lives in the backend."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, rope: PositionedRotary, x: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # Qwen3 normalises per head before RoPE
        q, k = rope(q, k)
        out = ctx.attend(self.layer_idx, q, k, v.contiguous())
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU feed-forward with gate and up fused into one projection."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(
            config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias
        )
        self.down_proj = nn.Linear(
            config.intermediate_size, config.hidden_size, bias=config.mlp_bias
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream is carried beside the block's output, as vLLM does, so each add
    fuses into the norm after it: the layer takes and returns (output, residual), and
    the input to the next norm is their sum.
    """

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self, rope: PositionedRotary, x: torch.Tensor, residual: torch.Tensor | None, ctx: AttentionContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`rope` is RoPE prepared for the pass's positions (``RotaryEmbedding.at``), once
        for all layers."""
        if residual is None:  # the first layer: its input is the residual
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x, residual = self.post_attention_layernorm(self.self_attn(rope, x, ctx), residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    """Embeddings, decoder layers and the final norm (HF's `model.` prefix)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.at(positions)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, ctx)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


# HF checkpoint name suffix -> (our parameter suffix, shard index) for the fused weights.
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


class LlamaForCausalLM(nn.Module):
    """Causal LM over a flat varlen batch.

    `forward(input_ids[T], positions[T], ctx)` returns final-normed hidden states
    [T, hidden]; `compute_logits` maps only the rows the caller needs to float32 logits.
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        # When tied there is no lm_head module at all: sharing a Parameter between two
        # modules would be split apart by meta-device construction + to_empty().
        # quantize_lm_head may later install an int8 head (engine/quantization/lm_head.py).
        self.lm_head: nn.Module | None = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def attention_spec(self) -> AttentionSpec:
        c = self.config
        return AttentionSpec(
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            scale=c.head_dim**-0.5,
            sliding_window=c.sliding_window,
        )

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        return F.linear(hidden, self.model.embed_tokens.weight).float()

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our (fused) parameters, casting to their dtype/device.

        Raises on a name we do not know, a shape mismatch, or any parameter left unloaded.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, int]] = set()  # (param name, shard index or -1)
        c = self.config
        qkv_sizes = [c.num_attention_heads * c.head_dim] + [c.num_key_value_heads * c.head_dim] * 2
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or (
                "rotary_emb.sin_cached" in name
            ):
                continue  # old checkpoints saved RoPE buffers; we compute our own
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the head is embed_tokens
            target, shard = name, -1
            for hf, (ours, idx) in _FUSED.items():
                if f".{hf}." in name:
                    target, shard = name.replace(f".{hf}.", f".{ours}."), idx
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            dst = param.data
            if shard >= 0:
                sizes = qkv_sizes if "qkv_proj" in target else [c.intermediate_size] * 2
                start = sum(sizes[:shard])
                dst = dst.narrow(0, start, sizes[shard])
            if dst.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                    f"expected {tuple(dst.shape)}"
                )
            dst.copy_(tensor)
            loaded.add((target, shard))
        missing = []
        for pname in params:
            shards = 3 if "qkv_proj" in pname else 2 if "gate_up_proj" in pname else 0
            needed = [(pname, i) for i in range(shards)] if shards else [(pname, -1)]
            missing += [f"{p}[{i}]" if i >= 0 else p for p, i in needed if (p, i) not in loaded]
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")
        self.model.rotary.build(self.model.embed_tokens.weight.device)
