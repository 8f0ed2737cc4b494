"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE (with its gated shared expert) and Qwen3-MoE.

They are the Llama-family decoder (``llama.py``) whose feed-forward block is, in some or
all layers, a ``SparseMoeBlock``: a router picks ``top_k`` of ``num_experts`` SwiGLU
experts per token, and the token's output is the routing-weighted sum of theirs. Each
expert is a ``llama.MLP``, so its projections are ``LinearLayer``s whose methods come from
the ``QuantConfig`` (dense, or int8/int4 at load) like every other projection.

Routing follows transformers exactly: router logits in the model's dtype, softmax in
fp32, top-k, renormalised over the kept experts when the config says so; Mixtral keeps
the weights in fp32, Qwen rounds them to the model's dtype. On CPU, tokens are grouped by
expert and each routed expert runs once per step on its tokens, its weighted output
index-added in ascending expert order (as transformers sums them). On CUDA, dense experts
are stacked once after loading and run through the fused Triton kernel
(``kernels/triton/fused_moe.py``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from cadence.engine.experts.routed_pairs import RoutedPairs
from cadence.engine.model_config import ModelConfig
from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.models.llama import MLP, LlamaForCausalLM, dense_mlp
from cadence.engine.models.weight_names import ours_from_mixtral
from cadence.engine.quantization.linear_layer import DenseMethod, LinearLayer, QuantConfig

if TYPE_CHECKING:
    from cadence.engine.experts.offloaded import OffloadedExperts

# Each checkpoint's names for an expert's gate, up and down projections.
_MIXTRAL_EXPERT = ("w1", "w3", "w2")
_QWEN_EXPERT = ("gate_proj", "up_proj", "down_proj")


class SparseMoeBlock(nn.Module):
    """A layer's routed experts (``model.layers.N.mlp``): ``gate`` (the router, a dense
    linear to one logit per expert), ``experts.E`` (SwiGLU MLPs) and, for Qwen2-MoE,
    ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))`` and added to their sum.

    ``forward(x [T, hidden]) -> [T, hidden]`` on a flat batch: routing is per token, so a
    token's output does not depend on which others share the step.
    """

    # On CUDA, the dense experts stacked for the fused kernel ([E, 2I, K] gate rows then
    # up, and [E, K, I]); each expert's own weights are views into them. None elsewhere.
    w13: torch.Tensor | None
    w2: torch.Tensor | None

    def __init__(self, config: ModelConfig, layer_idx: int, quant: QuantConfig) -> None:
        super().__init__()
        moe = config.moe
        if moe is None:
            raise ValueError(f"{config.architecture} has no MoE settings")
        hidden, prefix = config.hidden_size, f"model.layers.{layer_idx}.mlp"
        self.layer_idx, self.prefix, self.quant = layer_idx, prefix, quant
        self.hidden_size, self.intermediate_size = hidden, moe.intermediate_size
        self.num_experts, self.top_k = moe.num_experts, moe.num_experts_per_tok
        self.renormalize, self.weights_in_fp32 = moe.renormalize, moe.weights_in_fp32
        # The router stays dense whatever the quantization: it decides which experts run.
        self.gate = LinearLayer(
            hidden, [moe.num_experts], False, DenseMethod(), shard_names=("gate",), prefix=f"{prefix}.gate"
        )
        self.expert_names = _MIXTRAL_EXPERT if config.architecture == "MixtralForCausalLM" else _QWEN_EXPERT
        self.experts = nn.ModuleList(self.new_expert(e) for e in range(moe.num_experts))
        # The routed experts offloaded (engine/experts/): then ``experts`` is empty.
        self.offload: OffloadedExperts | None = None
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: LinearLayer | None = None
        if moe.shared_expert_intermediate_size:
            self.shared_expert = MLP(quant, f"{prefix}.shared_expert", hidden, moe.shared_expert_intermediate_size)
            self.shared_expert_gate = LinearLayer(
                hidden,
                [1],
                False,
                DenseMethod(),
                shard_names=("shared_expert_gate",),
                prefix=f"{prefix}.shared_expert_gate",
            )
        self.register_buffer("w13", None, persistent=False)
        self.register_buffer("w2", None, persistent=False)

    def new_expert(self, expert: int) -> MLP:
        """Expert ``expert`` as this layer builds it (on the current default device)."""
        mlp = MLP(
            self.quant,
            f"{self.prefix}.experts.{expert}",
            self.hidden_size,
            self.intermediate_size,
            shard_names=self.expert_names,
        )
        return mlp

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``topk_weights [T, top_k]`` (fp32 for Mixtral, else x's dtype) and ``topk_ids
        [T, top_k]`` (int64), in transformers' order of operations."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not self.weights_in_fp32:
            weights = weights.to(x.dtype)
        return weights, ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        if self.offload is not None:
            out = self.offload(x, weights, ids)
        elif self.runs_fused_kernel():
            assert self.w13 is not None and self.w2 is not None
            out = self.fused_experts(x, weights, ids, self.w13, self.w2)
        else:
            out = self.grouped_experts(x, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    def runs_fused_kernel(self) -> bool:
        """Whether resident experts go through the fused kernel: stacked, and still current."""
        return self.w13 is not None and self.w2 is not None and self.stacked_experts_current()

    def reads_routing_on_host(self) -> bool:
        """Whether a forward reads its routing on the host: offloaded experts, and the
        grouped path (its per-expert token counts), do; the fused kernel does not. A step
        that does cannot be captured in a CUDA graph."""
        return self.offload is not None or not self.runs_fused_kernel()

    def grouped_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The torch path: each routed expert run once on its tokens (``RoutedPairs``)."""
        pairs = RoutedPairs(x, weights, ids, self.num_experts)
        for expert in pairs.routed:
            pairs.run(expert, self.experts[expert])
        return pairs.combine()

    @staticmethod
    def fused_experts(
        x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
    ) -> torch.Tensor:
        """The fused Triton MoE (CUDA): two grouped GEMMs over the stacked experts."""
        from cadence.kernels.triton.fused_moe import fused_moe  # imports triton: only where it runs

        return fused_moe(x, w13, w2, weights.float(), ids.to(torch.int32))

    def stack_dense_experts(self) -> bool:
        """Stack dense experts' weights for the fused kernel, making each expert's weights
        views into the stacks (no second copy). Returns whether they were stacked: experts
        of another format keep the grouped path."""
        layers = [(e.gate_up_proj, e.down_proj) for e in self._experts()]
        if not layers or any(type(layer.method) is not DenseMethod for pair in layers for layer in pair):
            self.w13 = self.w2 = None
            return False
        self.w13 = torch.stack([gate_up.weight.detach() for gate_up, _ in layers])
        self.w2 = torch.stack([down.weight.detach() for _, down in layers])
        for e, (gate_up, down) in enumerate(layers):
            gate_up.weight = nn.Parameter(self.w13[e], requires_grad=False)
            down.weight = nn.Parameter(self.w2[e], requires_grad=False)
        return True

    def stacked_experts_current(self) -> bool:
        """Whether the stacks still hold the experts' weights: a later ``quantize_model``
        replaces every expert's method (checked on the first), and the stacks are then
        dropped for the grouped path."""
        first = next(iter(self._experts()), None)
        if first is None or type(first.gate_up_proj.method) is DenseMethod:
            return True
        self.w13 = self.w2 = None
        return False

    def _experts(self) -> Iterable[MLP]:
        for expert in self.experts:
            assert isinstance(expert, MLP)
            yield expert


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE and Qwen3-MoE: the Llama-family decoder with a ``SparseMoeBlock``
    in every sparse layer (``MoEConfig.is_sparse``) and the dense MLP in the others."""

    @staticmethod
    def feed_forward(config: ModelConfig, layer_idx: int, quant: QuantConfig) -> nn.Module:
        if config.moe is not None and config.moe.is_sparse(layer_idx):
            return SparseMoeBlock(config, layer_idx, quant)
        return dense_mlp(config, layer_idx, quant)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``LlamaForCausalLM.load_weights`` with Mixtral's ``block_sparse_moe`` read as
        ``mlp``; then, on CUDA, each layer's dense experts stacked for the fused kernel."""
        super().load_weights((ours_from_mixtral(name), tensor) for name, tensor in weights)
        for module in self.modules():
            if isinstance(module, SparseMoeBlock) and module.gate.weight.is_cuda:
                module.stack_dense_experts()


def routes_on_host(model: CausalLM | nn.Module) -> bool:
    """Whether any of the model's MoE layers reads its routing on the host every step."""
    return any(isinstance(m, SparseMoeBlock) and m.reads_routing_on_host() for m in model.modules())
