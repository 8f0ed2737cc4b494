"""The user's expert-offloading choices (``--expert-offload`` and friends)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from cadence.engine.experts.policy import POLICIES

OFFLOAD_MODES = ("none", "host", "disk")


@dataclass(frozen=True)
class ExpertOffloadOptions:
    # "host": the routed experts sit in host memory (pinned on CUDA); "disk": they are
    # read from memory-mapped files when needed; "none": every expert stays resident.
    mode: str = "none"
    # Expert slots per MoE layer in fast memory; None: twice the experts per token.
    cache_size: int | None = None
    policy: str = "lru"  # which cached expert gives up its slot: "lru" or "lfu"
    prefetch: bool = True  # predict the next layer's experts with its router, load them early
    # Stream a layer through two buffers instead of caching when a step routes more than
    # this many distinct experts to it; None: the device's default (``default_stream_threshold``).
    stream_threshold: int | None = None
    # CUDA: run a cold expert with few tokens on the CPU when that beats copying it.
    cpu_compute: bool = False
    # Where "disk" writes quantized experts (a checkpoint only holds dense ones).
    spill_dir: str = os.path.join("~", ".cache", "cadence", "expert-spill")

    def __post_init__(self) -> None:
        if self.mode not in OFFLOAD_MODES:
            raise ValueError(f"expert_offload must be one of {', '.join(OFFLOAD_MODES)}, not {self.mode!r}")
        if self.cache_size is not None and self.cache_size < 1:
            raise ValueError(f"expert_cache_size must be at least 1, not {self.cache_size}")
        if self.policy not in POLICIES:
            raise ValueError(f"expert_cache_policy must be one of {', '.join(sorted(POLICIES))}, not {self.policy!r}")
        if self.stream_threshold is not None and self.stream_threshold < 0:
            raise ValueError(f"expert_stream_threshold must be 0 or more, not {self.stream_threshold}")
        if self.mode == "none" and (
            self.cache_size is not None or self.stream_threshold is not None or self.cpu_compute
        ):
            raise ValueError(
                "expert_cache_size, expert_stream_threshold and expert_cpu_compute need expert_offload host or disk"
            )

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def stream_threshold_for(self, device_type: str, num_experts: int, slots: int) -> int:
        """On CPU never stream: a copy there takes the same memory bandwidth the experts
        compute with, so streaming gains little overlap and moves twice the bytes that
        caching with waves does (bench/RESULTS.md, expert offloading: caching was 1.08-1.13x
        streaming at batch 32). On CUDA, stream once a step routes more experts than the
        cache holds (MoE-Lightning's regime: copies ride the PCIe DMA engines beside compute)."""
        if self.stream_threshold is not None:
            return self.stream_threshold
        return num_experts if device_type == "cpu" else slots

    def slots_per_layer(self, num_experts: int, experts_per_token: int) -> int:
        return min(self.cache_size or 2 * experts_per_token, num_experts)
