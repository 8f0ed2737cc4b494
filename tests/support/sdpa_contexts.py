"""Test-only stand-ins for the paged attention backend: plain causal SDPA per sequence
(with the sliding window when the spec has one), so model tests check the model, config
parsing, RoPE and weight loading independently of the real backend."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cadence.engine.attention.backend import AttentionSpec


def _attend_one(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, spec: AttentionSpec
) -> torch.Tensor:
    """Causal (optionally windowed) attention of q [L,H,D] over k/v [S,KV,D] by positions."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if spec.sliding_window is not None:
        allowed &= q_pos[:, None] - k_pos[None, :] < spec.sliding_window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=allowed,
        scale=spec.scale,
        enable_gqa=True,
    )
    return out.transpose(0, 1)


class VarlenSdpaContext:
    """Duck-typed ForwardContext: prefill-only, each sequence attends only to itself."""

    def __init__(self, spec: AttentionSpec, seq_lens: list[int]) -> None:
        self.spec, self.seq_lens = spec, seq_lens

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        for n in self.seq_lens:
            pos = torch.arange(n, device=q.device)
            s = slice(start, start + n)
            outs.append(_attend_one(q[s], k[s], v[s], pos, pos, self.spec))
            start += n
        return torch.cat(outs)


class CachedSdpaContext:
    """Duck-typed ForwardContext for one sequence that keeps a growing K/V cache."""

    def __init__(self, spec: AttentionSpec, num_layers: int) -> None:
        self.spec = spec
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers
        self.start = 0  # position of the first token in the current step

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        old_k, old_v = self.k[layer_idx], self.v[layer_idx]
        self.k[layer_idx] = k if old_k is None else torch.cat([old_k, k])
        self.v[layer_idx] = v if old_v is None else torch.cat([old_v, v])
        k_all, v_all = self.k[layer_idx], self.v[layer_idx]
        assert k_all is not None and v_all is not None
        q_pos = torch.arange(self.start, self.start + q.shape[0], device=q.device)
        return _attend_one(q, k_all, v_all, q_pos, torch.arange(k_all.shape[0], device=q.device), self.spec)
