"""One MoE layer's routed experts, offloaded: a pool of slots in fast memory (cache slots
then two stream buffers), the store the experts come from, and the step that runs them.

A step groups its (token, expert) pairs by expert with ``RoutedPairs``, as the resident
path does, then follows ``cache.step_actions``: loads go to the transfer queue, runs wait
for their slot's load. When the step routes more distinct experts than ``stream_threshold``, it
streams: the routed experts that are not cached pass through the two stream buffers in
turn (each loaded while the one before computes), and the cache keeps what it holds;
otherwise the misses take cache slots, evicting by the policy, in waves when they
outnumber the slots. Once its own misses are queued, the layer applies the next MoE
layer's router to its own input to predict the next layer's experts and queues their
loads (``prefetch``). ``RoutedPairs.combine`` adds the experts' weighted outputs in
ascending expert order whatever order they ran in, so the output is the same bits
whatever was resident.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from cadence.engine.experts.cache import ExpertCache, Load, StreamBuffers, prefetch_actions, step_actions
from cadence.engine.experts.cost_model import CpuComputeCost
from cadence.engine.experts.routed_pairs import RoutedPairs
from cadence.engine.experts.stats import ExpertStats
from cadence.engine.experts.store import ExpertSource, slot_tensors
from cadence.engine.experts.transfer import ExpertTransfers, Ticket
from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.quantization.linear_layer import LinearLayer

# (hidden states [T, hidden]) -> routed expert ids [T, top_k]: a layer's router.
Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class OffloadedExperts(nn.Module):
    def __init__(
        self,
        slots: list[nn.Module],
        sources: list[ExpertSource],
        cache: ExpertCache,
        transfers: ExpertTransfers,
        stats: ExpertStats,
        stream_threshold: int,
        cpu_compute: tuple[nn.Module, CpuComputeCost] | None = None,
        bind: bool = False,
    ) -> None:
        super().__init__()
        if len(slots) != cache.num_slots + 2:
            raise ValueError("an offloaded layer needs its cache slots and two stream buffers")
        self.slots = nn.ModuleList(slots)
        for module in [*slots, *([cpu_compute[0]] if cpu_compute else [])]:
            for layer in module.modules():
                if isinstance(layer, LinearLayer):
                    # A load replaces the weights: the CPU planner gives these layers no
                    # kernel that reads a copy made from them once.
                    layer.weights_fixed = False
        self.sources, self.cache, self.transfers, self.stats = sources, cache, transfers, stats
        # The sources are already in the memory the slots compute from (host memory on a
        # CPU device): a load points the slot at the source's tensors instead of copying,
        # and the slots' own storage is let go at once.
        self.bind = bind
        if bind:
            for slot in slots:
                sources[0].bind_into(slot)
        self.tensors = [] if bind else [slot_tensors(m) for m in slots]
        self.num_experts = len(sources)
        self.stream_threshold = stream_threshold
        self.stream_buffers = StreamBuffers(cache.num_slots)
        self.pending: dict[int, Ticket] = {}  # slot -> its latest load
        self.predicted: set[int] | None = None  # experts a prefetch expected this layer to route
        self.next_layer: tuple[OffloadedExperts, Router] | None = None  # set by the builder; not a submodule
        # (CUDA) a CPU copy of a slot and the copy-or-compute costs: cold experts with few
        # tokens run there from host memory instead of being copied.
        self.cpu_compute = cpu_compute
        self.prefetch_enabled = True

    # ---- a step

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        pairs = RoutedPairs(x, weights, ids, self.num_experts)
        needed = pairs.routed
        self._score_prediction(needed)
        hits = [e for e in needed if self.cache.resident(e) is not None]
        self.stats.hits += len(hits)
        self.stats.misses += len(needed) - len(hits)
        self.cache.policy.record(needed)
        on_cpu = self._cpu_experts(needed, hits, pairs.counts)
        for expert in on_cpu:
            self._run_on_cpu(expert, pairs)
        to_slots = [e for e in needed if e not in on_cpu]
        streaming = len(to_slots) > self.stream_threshold
        claim = self.stream_buffers.claim if streaming else self.cache.claim
        self.stream_buffers.begin_step()
        self.stats.streamed_layers += streaming
        self.stats.cached_layers += bool(to_slots) and not streaming
        # The next layer's prefetch goes behind this layer's last load in the queue (the
        # queue is first come, first served): at the first run once every miss is queued.
        loads_left = len(to_slots) - len(hits)  # every miss not run on the CPU loads once
        prefetched = False
        ran = False
        for action in step_actions(to_slots, self.cache.resident, claim):
            if isinstance(action, Load):
                self.stats.waves += ran and not streaming  # a slot had to be freed by running first
                ran = False
                loads_left -= 1
                self._load(action.expert, action.slot)
                continue
            ran = True
            if not prefetched and loads_left == 0:
                self._prefetch_next(x)
                prefetched = True
            self._wait(action.slot)
            pairs.run(action.expert, self.slots[action.slot])
        if not prefetched:
            self._prefetch_next(x)
        return pairs.combine()

    # ---- loads

    def _load(self, expert: int, slot: int) -> None:
        source, module = self.sources[expert], self.slots[slot]
        if self.bind:
            source.bind_into(module)
            return
        tensors = self.tensors[slot]
        non_blocking = self.transfers.stream is not None

        def copy() -> None:
            source.copy_into(tensors, non_blocking)

        try:
            self.pending[slot] = self.transfers.submit(copy)
        except BaseException:
            self.cache.forget_slot(slot)
            raise
        self.stats.load_bytes += source.nbytes

    def _wait(self, slot: int) -> None:
        ticket = self.pending.pop(slot, None)
        if ticket is None:
            return
        try:
            self.stats.stall_seconds += self.transfers.wait(ticket)
        except BaseException:
            self.cache.forget_slot(slot)  # its contents are unknown: the next use loads again
            raise

    # ---- prefetch

    def _prefetch_next(self, x: torch.Tensor) -> None:
        """Predict the next MoE layer's experts from this layer's input and queue their loads."""
        if self.next_layer is None or not self.prefetch_enabled:
            return
        layer, router = self.next_layer
        _, ids = router(x)
        counts = torch.bincount(ids.flatten(), minlength=layer.num_experts).tolist()
        ranked = sorted((e for e, c in enumerate(counts) if c), key=lambda e: -counts[e])
        layer.predicted = set(ranked)
        if len(ranked) > layer.stream_threshold:
            return  # that layer will stream: its cache keeps what it has
        for action in prefetch_actions(ranked, layer.cache):
            layer._load(action.expert, action.slot)
            self.stats.prefetch_loads += 1

    def _score_prediction(self, needed: list[int]) -> None:
        if self.predicted is None:
            return
        self.stats.prefetch_predicted += len(self.predicted)
        self.stats.prefetch_correct += len(self.predicted.intersection(needed))
        self.stats.prefetch_routed += len(needed)
        self.predicted = None

    # ---- CPU compute of cold experts (CUDA)

    def _cpu_experts(self, needed: list[int], hits: list[int], counts: list[int]) -> set[int]:
        if self.cpu_compute is None:
            return set()
        cost = self.cpu_compute[1]
        resident = set(hits)
        return {e for e in needed if e not in resident and cost.prefers_cpu(counts[e])}

    def _run_on_cpu(self, expert: int, pairs: RoutedPairs) -> None:
        assert self.cpu_compute is not None
        module = self.cpu_compute[0]
        self.sources[expert].copy_into(slot_tensors(module))
        self.stats.cpu_computed += 1
        pairs.run(expert, _OnCpu(module, pairs.x.device))


class _OnCpu(nn.Module):
    """Runs a CPU module on device activations: rows to the host and the result back."""

    def __init__(self, module: nn.Module, device: torch.device) -> None:
        super().__init__()
        self.module, self.device = module, device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x.to("cpu")).to(self.device)


def offloaded_stats(model: CausalLM | nn.Module) -> ExpertStats | None:
    """The model's shared expert-offloading totals, or None when no layer offloads."""
    for module in model.modules():
        if isinstance(module, OffloadedExperts):
            return module.stats
    return None
