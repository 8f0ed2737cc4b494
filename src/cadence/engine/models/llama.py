"""Llama-family decoder: Llama 2/3, Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm), SmolLM2.

Works on a flattened varlen batch: `input_ids` and `positions` are [T] with tokens from
many sequences back to back; only attention (through the step's `ForwardContext`) mixes
tokens. q/k/v and gate/up are each one fused ``LinearLayer``
(``weight_names.FUSED_SHARDS``), so every layer runs three big GEMMs plus the output
projection instead of seven small ones. Each projection's weight format comes from the
``QuantConfig`` the model is built with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from cadence.engine.attention.backend import AttentionSpec
from cadence.engine.forward_context import ForwardContext
from cadence.engine.model_config import ModelConfig
from cadence.engine.models.rotary import PositionedRotary, RotaryEmbedding
from cadence.engine.models.weight_names import FUSED_SHARDS, LM_HEAD, expert_target, fused_target
from cadence.engine.quantization.linear import Int8Method
from cadence.engine.quantization.linear_layer import (
    DenseConfig,
    DenseMethod,
    LinearLayer,
    QuantConfig,
    batch_invariant_dense,
)
from cadence.engine.quantization.lm_head import Int8Embedding
from cadence.kernels.batch_invariant.cpu_linear import invariant_linear
from cadence.kernels.cpu import bf16_dot
from cadence.kernels.layer_ops import rms_norm, silu_and_mul


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


def projection(
    quant: QuantConfig, prefix: str, fused: str, input_size: int, output_sizes: list[int], bias: bool
) -> LinearLayer:
    """The decoder projection ``prefix.fused`` with the method ``quant`` gives it."""
    name = f"{prefix}.{fused}"
    shards = tuple(hf.rsplit(".", 1)[-1] for hf in FUSED_SHARDS[fused])
    return LinearLayer(
        input_size, output_sizes, bias, quant.linear_method(name, shards, input_size), shard_names=shards, prefix=name
    )


def checkpoint_target(module: str, layers: dict[str, LinearLayer]) -> tuple[str, int] | None:
    """The layer and shard a checkpoint module loads into: a fused decoder projection's
    shard, an expert's (``weight_names.expert_target``), or a one-shard layer named as in
    the checkpoint (the head, an MoE router); None for a plain parameter's module."""
    if module == LM_HEAD:
        return module, 0
    target = expert_target(module) or fused_target(module)
    if target is None and module in layers and len(layers[module].output_sizes) == 1:
        return module, 0
    return target


class Attention(nn.Module):
    """Self-attention with fused qkv projection and RoPE; the cache lives in the backend."""

    def __init__(self, config: ModelConfig, layer_idx: int, quant: QuantConfig) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        prefix = f"model.layers.{layer_idx}"
        self.qkv_proj = projection(
            quant,
            prefix,
            "self_attn.qkv_proj",
            config.hidden_size,
            [self.q_size, self.kv_size, self.kv_size],
            config.qkv_bias,
        )
        self.o_proj = projection(quant, prefix, "self_attn.o_proj", self.q_size, [config.hidden_size], config.o_bias)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, rope: PositionedRotary, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
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
    """SwiGLU feed-forward with gate and up fused into one projection: a dense layer's MLP,
    and each MoE expert (``shard_names``: the checkpoint's gate, up and down modules)."""

    def __init__(
        self,
        quant: QuantConfig,
        prefix: str,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        shard_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        gate, up, down = shard_names
        name = f"{prefix}.gate_up_proj"
        self.gate_up_proj = LinearLayer(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias,
            quant.linear_method(name, (gate, up), hidden_size),
            shard_names=(gate, up),
            prefix=name,
        )
        name = f"{prefix}.down_proj"
        self.down_proj = LinearLayer(
            intermediate_size,
            [hidden_size],
            bias,
            quant.linear_method(name, (down,), intermediate_size),
            shard_names=(down,),
            prefix=name,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


def dense_mlp(config: ModelConfig, layer_idx: int, quant: QuantConfig) -> nn.Module:
    """A decoder layer's dense feed-forward (``model.layers.N.mlp``)."""
    prefix = f"model.layers.{layer_idx}.mlp"
    return MLP(quant, prefix, config.hidden_size, config.intermediate_size, config.mlp_bias)


# Builds a decoder layer's feed-forward block: the dense MLP, or an MoE block (moe.py).
FeedForward = Callable[[ModelConfig, int, QuantConfig], nn.Module]


class DecoderLayer(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x)).

    The residual stream is carried beside the block's output, as vLLM does, so each add
    fuses into the norm after it: the layer takes and returns (output, residual), and
    the input to the next norm is their sum.
    """

    def __init__(
        self, config: ModelConfig, layer_idx: int, quant: QuantConfig, feed_forward: FeedForward = dense_mlp
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx, quant)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = feed_forward(config, layer_idx, quant)

    def forward(
        self, rope: PositionedRotary, x: torch.Tensor, residual: torch.Tensor | None, ctx: ForwardContext
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

    def __init__(self, config: ModelConfig, quant: QuantConfig, feed_forward: FeedForward = dense_mlp) -> None:
        super().__init__()
        self.rotary = RotaryEmbedding(
            config.head_dim,
            config.max_position_embeddings,
            config.rope_theta,
            config.rope_scaling,
        )
        self.embed_tokens: nn.Embedding | Int8Embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, quant, feed_forward) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.at(positions)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, ctx)
        if residual is None:  # no layers
            return self.norm(x)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    """Causal LM over a flat varlen batch.

    `forward(input_ids[T], positions[T], ctx)` returns final-normed hidden states
    [T, hidden]; `compute_logits` maps only the rows the caller needs to float32 logits.
    """

    def __init__(self, config: ModelConfig, quant: QuantConfig | None = None) -> None:
        super().__init__()
        quant = quant or DenseConfig()
        self.config = config
        self.model = LlamaModel(config, quant, self.feed_forward)
        # A dense tied head is no module at all: compute_logits reads the embedding (sharing
        # a Parameter between two modules would be split apart by meta-device construction
        # + to_empty()). A quantized head is a layer of its own; an int8 one tied to the
        # embedding also serves the lookups (Int8Embedding), and the dense table is dropped.
        self.lm_head: LinearLayer | None = None
        # Whether a dense tied head runs the batch-invariant GEMM (engine/batch_invariant.py).
        self.batch_invariant = False
        # A dense tied head under the CPU's bf16 precision: the embedding packed for bf16dot
        # (engine/quantization/dense_dot.py).
        self.cpu_head_dot: bf16_dot.DotWeight | None = None
        head = quant.lm_head
        if head is not None or not config.tie_word_embeddings:
            self.lm_head = LinearLayer(
                config.hidden_size,
                [config.vocab_size],
                False,
                head or DenseMethod(),
                shard_names=(LM_HEAD,),
                prefix=LM_HEAD,
            )
            if config.tie_word_embeddings and isinstance(head, Int8Method):
                self.model.embed_tokens = Int8Embedding(self.lm_head)

    @staticmethod
    def feed_forward(config: ModelConfig, layer_idx: int, quant: QuantConfig) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward block (an MoE model's class returns its MoE block)."""
        return dense_mlp(config, layer_idx, quant)

    def attention_spec(self) -> AttentionSpec:
        c = self.config
        return AttentionSpec(
            num_heads=c.num_attention_heads,
            num_kv_heads=c.num_key_value_heads,
            head_dim=c.head_dim,
            scale=c.head_dim**-0.5,
            sliding_window=c.sliding_window,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.model(input_ids, positions, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        embedding = self.model.embed_tokens
        assert isinstance(embedding, nn.Embedding)  # an Int8Embedding always comes with its head
        if self.batch_invariant:
            return batch_invariant_dense(hidden, embedding.weight).float()
        if hidden.is_cuda:
            return F.linear(hidden, embedding.weight).float()
        if self.cpu_head_dot is not None:
            return bf16_dot.linear(hidden.float(), self.cpu_head_dot)
        return invariant_linear(hidden, embedding.weight).float()  # as DenseMethod on CPU

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into our parameters, and each projection's shards through
        its ``LinearLayer``'s method (which casts, concatenates or keeps them packed).

        Raises on a name we do not know, a shape mismatch, or any tensor left unloaded.
        ``process_after_loading`` on every ``LinearLayer`` finishes the job (the loader's).
        """
        # Every name a module has: a tied int8 head is also the embedding's ``table``.
        layers = {name: m for name, m in self.named_modules(remove_duplicate=False) if isinstance(m, LinearLayer)}
        params = {
            name: p
            for name, p in self.named_parameters(remove_duplicate=False)
            if name.rpartition(".")[0] not in layers
        }  # the layers' own are their methods'
        for layer in layers.values():
            layer.loaded.clear()  # a second pass (a test's) starts over
        head_reads_embedding = isinstance(self.model.embed_tokens, Int8Embedding)
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or "rotary_emb.cos_cached" in name or ("rotary_emb.sin_cached" in name):
                continue  # old checkpoints saved RoPE buffers; we compute our own
            module, _, attr = name.rpartition(".")
            if module == LM_HEAD and (self.lm_head is None or head_reads_embedding):
                continue  # tied: the head is the embedding table (an int8 head loads it from there)
            if module == "model.embed_tokens" and head_reads_embedding:
                module = LM_HEAD  # the tied int8 head holds the table
            target = checkpoint_target(module, layers)
            if target is not None and target[0] in layers:
                layers[target[0]].load(target[1], attr, tensor)
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"unexpected weight {name!r} in checkpoint")
            if param.shape != tensor.shape:
                raise ValueError(
                    f"shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, expected {tuple(param.shape)}"
                )
            param.data.copy_(tensor)
            loaded.add(name)
        missing = [p for p in params if p not in loaded]
        for layer in {id(m): m for m in layers.values()}.values():
            missing += layer.missing()
        if missing:
            raise ValueError(f"checkpoint is missing weights: {', '.join(missing[:8])}")
        self.model.rotary.build(self.model.norm.weight.device)
