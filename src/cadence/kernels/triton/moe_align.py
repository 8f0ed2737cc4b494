"""Sort (token, expert) pairs by expert and pad each expert's run to a block multiple.

The fused MoE kernels (``fused_moe``) are grouped GEMMs: every program owns BLOCK_M rows
that all belong to one expert, so it can load that expert's weight tile once. This module
builds that schedule from the router's ``topk_ids [M, top_k]``:

* a *pair* is one (token, slot) routing decision, numbered ``token * top_k + slot``;
* ``sorted_ids`` lists pair numbers grouped by expert, each expert's run padded to a
  multiple of ``block_m`` with the sentinel ``M * top_k`` (an out-of-range pair the
  kernels mask out);
* ``expert_ids[b]`` is the expert of block ``b``, or -1 for blocks past the used range.

It is plain torch on whatever device ``topk_ids`` lives on, with no host sync: the
buffers have the worst-case size (``pairs + min(E, pairs) * (block_m - 1)`` rows), and
unused trailing blocks carry expert -1 so the kernels return at once. The exact size
would need ``.item()``, which stalls the GPU stream and breaks CUDA-graph capture. Experts
that receive no tokens get no blocks, hence no work. Within an expert the order is the
pair order (a stable sort), so results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class MoEAlignment:
    """The expert-sorted, block-padded schedule the grouped GEMMs run over."""

    sorted_ids: torch.Tensor  # int32 [num_blocks * block_m]: pair ids, sentinel = num_pairs
    expert_ids: torch.Tensor  # int32 [num_blocks]: expert of each block, -1 = unused
    num_tokens_post_padded: torch.Tensor  # int32 [1]: rows actually used (a device scalar)
    num_pairs: int  # M * top_k, also the padding sentinel
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.expert_ids.shape[0]


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case padded length: each non-empty expert wastes at most block_m - 1 rows."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (worst + block_m - 1) // block_m * block_m


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> MoEAlignment:
    """Build the :class:`MoEAlignment` for ``topk_ids [M, top_k]`` (ids in ``[0, E)``)."""
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    if not topk_ids.is_cuda and n and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        # Free to check on CPU; on a GPU it would cost a sync, so ids are trusted there.
        raise ValueError(f"topk_ids must lie in [0, {num_experts})")
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts

    order = torch.argsort(flat, stable=True)  # pair ids, grouped by expert
    experts = flat[order]
    rank = torch.arange(n, device=device) - start[experts]  # position within its expert
    total = max_padded_pairs(n, num_experts, block_m)
    sorted_ids = torch.full((total,), n, dtype=torch.int32, device=device)
    sorted_ids[padded_start[experts] + rank] = order.to(torch.int32)

    # Block b belongs to the first expert whose cumulative block count exceeds b; blocks
    # past the last expert's end get E, turned into -1.
    blocks = torch.arange(total // block_m, device=device)
    expert_ids = torch.searchsorted(padded_end // block_m, blocks, right=True)
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    return MoEAlignment(sorted_ids, expert_ids, padded_end[-1:].to(torch.int32), n, block_m)
