"""One MoE layer's step, grouped by expert: ``RoutedPairs``, which both the resident path
(``models/moe.py``) and the offloaded one (``experts/offloaded.py``) run their experts through,
so both sum the experts' outputs in the same order and give the same bits."""

from __future__ import annotations

import itertools

import torch
from torch import nn


class RoutedPairs:
    """One step's (token, expert) pairs of a layer, sorted by expert (one host sync, for
    the per-expert counts). Each routed expert runs once on its tokens, in any order
    (``run``); ``combine`` then index-adds the weighted rows in ascending expert order, as
    transformers sums them, so the result does not depend on the order experts ran in:
    the resident and the offloaded paths give the same bits."""

    def __init__(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> None:
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        self.x = x
        self.tokens = order // ids.shape[-1]
        self.weights = weights.flatten()[order]
        self.counts: list[int] = torch.bincount(flat, minlength=num_experts).tolist()
        self.starts = list(itertools.accumulate(self.counts[:-1], initial=0))
        self.routed = [e for e, count in enumerate(self.counts) if count]
        self.out = torch.empty(flat.numel(), x.shape[-1], dtype=x.dtype, device=x.device)

    def run(self, expert: int, module: nn.Module) -> None:
        """``module`` (the expert's weights) on the expert's tokens, times their routing weights."""
        s, c = self.starts[expert], self.counts[expert]
        rows = self.tokens[s : s + c]
        self.out[s : s + c] = module(self.x.index_select(0, rows)) * self.weights[s : s + c, None]

    def combine(self) -> torch.Tensor:
        out = torch.zeros_like(self.x)
        for expert in self.routed:
            s, c = self.starts[expert], self.counts[expert]
            out.index_add_(0, self.tokens[s : s + c], self.out[s : s + c])
        return out
