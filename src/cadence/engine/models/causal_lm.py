"""``CausalLM``: what the engine, the loader and the tools call on a model, and
``ModelClass``: how the loader builds one."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from cadence.engine.attention.backend import AttentionSpec
from cadence.engine.forward_context import ForwardContext
from cadence.engine.model_config import ModelConfig

if TYPE_CHECKING:
    from typing_extensions import Self  # typing.Self is 3.11+; requires-python allows 3.10

    from cadence.engine.quantization.linear_layer import QuantConfig


class CausalLM(Protocol):
    """A causal LM over a flat varlen batch (an ``nn.Module``; ``LlamaForCausalLM`` is one).

    ``forward(input_ids[T], positions[T], ctx)`` returns final-normed hidden states
    ``[T, hidden]``; ``compute_logits`` maps only the rows the caller needs to float32
    logits, so the vocabulary-sized GEMM runs on sampled positions alone.
    """

    config: ModelConfig
    # A dense head tied to the embedding (no LinearLayer of its own) runs the batch-invariant
    # GEMM; the engine sets it with every LinearLayer's flag (engine/batch_invariant.py).
    batch_invariant: bool

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def attention_spec(self) -> AttentionSpec: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Checkpoint-named tensors into the model's layers (each through its QuantMethod)."""
        ...

    # The nn.Module surface the engine and loader use.
    def modules(self) -> Iterator[nn.Module]: ...

    def named_modules(self) -> Iterator[tuple[str, nn.Module]]: ...

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]: ...

    def get_submodule(self, target: str) -> nn.Module: ...

    def to(
        self,
        device: torch.device | str | int | None = None,
        dtype: torch.dtype | None = None,
        non_blocking: bool = False,
    ) -> Self: ...

    def to_empty(self, *, device: torch.device | str | None, recurse: bool = True) -> Self: ...

    def eval(self) -> Self: ...

    def requires_grad_(self, requires_grad: bool = True) -> Self: ...


class ModelClass(Protocol):
    """A model architecture: built from its config and the QuantConfig choosing its layers' methods."""

    def __call__(self, config: ModelConfig, quant: QuantConfig | None = None) -> CausalLM: ...
