"""Loading a mixture-of-experts model with its routed experts offloaded.

``ExpertOffloadBuilder`` takes part in ``load_model``: before the model gets storage it
empties each MoE layer's expert list (``prepare``), so no expert is ever allocated in
fast memory; while the checkpoint streams past it takes the routed experts' tensors out
(``weights``), turning each complete expert into an ``ExpertSource``; at the end it gives
every MoE layer its ``OffloadedExperts`` (``finish``): the cache slots and two stream
buffers, copies of one expert built the way the engine runs experts (so a slot holds
any expert, quantized or not), and the next layer's router for prefetching.
"""

from __future__ import annotations

import copy
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from cadence.engine.experts.cache import ExpertCache
from cadence.engine.experts.cost_model import CpuComputeCost, measure
from cadence.engine.experts.mapped_file import MappedFile, MappedTensor, mapped_safetensors
from cadence.engine.experts.offloaded import OffloadedExperts
from cadence.engine.experts.options import ExpertOffloadOptions
from cadence.engine.experts.policy import make_policy
from cadence.engine.experts.stats import ExpertStats
from cadence.engine.experts.store import ExpertSource, SpillFile, TensorCopy, host_source, slot_tensors
from cadence.engine.experts.transfer import ExpertTransfers
from cadence.engine.model_config import ModelConfig
from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.models.llama import MLP
from cadence.engine.models.moe import SparseMoeBlock
from cadence.engine.models.weight_names import expert_target, ours_from_mixtral
from cadence.engine.quantization.linear_layer import DenseMethod, LinearLayer

logger = logging.getLogger(__name__)
Item = torch.Tensor | MappedTensor


@dataclass(frozen=True)
class _ExpertTensor:
    layer: int
    expert: int
    fused: str  # "gate_up_proj" or "down_proj"
    shard: int
    attr: str


def _routed_expert(name: str) -> _ExpertTensor | None:
    """``model.layers.3.mlp.experts.5.w3.weight`` -> layer 3, expert 5, gate_up_proj shard 1."""
    module, _, attr = ours_from_mixtral(name).rpartition(".")
    target = expert_target(module)
    if target is None:
        return None
    parent, _, fused = target[0].rpartition(".")
    head, _, expert = parent.rpartition(".")
    head, _, experts = head.rpartition(".")
    parts = head.split(".")
    if experts != "experts" or not expert.isdigit() or len(parts) != 4 or parts[:2] != ["model", "layers"]:
        return None
    return _ExpertTensor(int(parts[2]), int(expert), fused, target[1], attr)


class ExpertOffloadBuilder:
    def __init__(
        self, options: ExpertOffloadOptions, config: ModelConfig, device: torch.device, dtype: torch.dtype
    ) -> None:
        if config.moe is None:
            raise ValueError(
                f"expert offloading needs a mixture-of-experts model; {config.architecture} has no experts"
            )
        if options.cpu_compute and device.type != "cuda":
            raise ValueError(
                "expert_cpu_compute runs cold experts on the CPU instead of copying them to the GPU; "
                "it needs a CUDA device"
            )
        self.options, self.device, self.dtype = options, device, dtype
        self.num_experts = config.moe.num_experts
        self.cache_size = options.slots_per_layer(config.moe.num_experts, config.moe.num_experts_per_tok)
        self.blocks: dict[int, SparseMoeBlock] = {}
        self.expected: int = 0  # checkpoint tensors per expert
        self.dense = True  # experts stay dense (else: quantized as they load)
        self.collected: dict[tuple[int, int], dict[_ExpertTensor, Item]] = {}
        self.sources: dict[int, list[ExpertSource | None]] = {}
        self.spilled: dict[tuple[int, int], int] = {}
        self.templates: dict[int, nn.Module] = {}
        self.files: list[MappedFile] = []
        self.spill: SpillFile | None = None

    # ---- before the model has storage

    def prepare(self, model: CausalLM) -> None:
        for module in model.modules():
            if isinstance(module, SparseMoeBlock):
                module.experts = nn.ModuleList()
                self.blocks[module.layer_idx] = module
                self.sources[module.layer_idx] = [None] * self.num_experts
        if not self.blocks:
            raise ValueError("expert offloading: this model has no sparse (MoE) layer")
        first = next(iter(self.blocks.values()))
        with torch.device("meta"):
            probe = first.new_expert(0)
        layers = [m for m in probe.modules() if isinstance(m, LinearLayer)]
        self.expected = sum(len(m.method.expected_tensors(m)) * len(m.output_sizes) for m in layers)
        if self.expected == 0:
            # GPTQ/AWQ and GGUF experts arrive in formats whose tensors only their own
            # loaders know; offloading builds experts from dense checkpoint tensors.
            raise ValueError(
                "expert offloading loads experts from a dense checkpoint; this one stores them "
                "pre-quantized. Offload a dense checkpoint, quantized at load with --quantization int8|int4"
            )
        self.dense = all(type(m.method) is DenseMethod for m in layers)
        if self.options.cpu_compute and not self.dense:
            raise ValueError("expert_cpu_compute runs dense experts only; leave the experts unquantized")
        if self.options.mode == "disk" and not self.dense:
            self.spill = SpillFile(os.path.expanduser(self.options.spill_dir))

    # ---- while the checkpoint streams past

    def weights(
        self, files: Iterable[str], read: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint without its routed experts (which this builder keeps): read
        through ``read``, or, for ``disk``, mapped from ``files``."""
        items: Iterable[tuple[str, Item]] = read
        if self.options.mode == "disk":
            items = self._mapped(files)
        for name, item in items:
            found = _routed_expert(name)
            if found is None or found.layer not in self.blocks:
                yield name, item.tensor if isinstance(item, MappedTensor) else item
                continue
            collected = self.collected.setdefault((found.layer, found.expert), {})
            collected[found] = item
            if len(collected) == self.expected:
                self._complete(found.layer, found.expert, self.collected.pop((found.layer, found.expert)))

    def _mapped(self, files: Iterable[str]) -> Iterator[tuple[str, MappedTensor]]:
        for path in files:
            for name, view in mapped_safetensors(path):
                if not self.files or self.files[-1] is not view.file:
                    self.files.append(view.file)
                yield name, view

    def _complete(self, layer: int, expert: int, items: dict[_ExpertTensor, Item]) -> None:
        block = self.blocks[layer]
        if self.options.mode == "disk" and self.dense:
            if layer not in self.templates:
                self.templates[layer] = self._build(block, expert, items)
            self.sources[layer][expert] = self._mapped_source(self.templates[layer], items)
            return
        built = self._build(block, expert, items)
        self.templates.setdefault(layer, built)
        if self.spill is not None:
            self.spilled[(layer, expert)] = self.spill.append(built)
        else:
            self.sources[layer][expert] = host_source(built, pin=self.device.type == "cuda")
        for item in items.values():
            if isinstance(item, MappedTensor):
                item.release()

    def _build(self, block: SparseMoeBlock, expert: int, items: dict[_ExpertTensor, Item]) -> nn.Module:
        """The expert as the engine runs it: built on the device, loaded, quantized if the
        model is."""
        with torch.device(self.device):
            built = block.new_expert(expert)
        built.to(dtype=self.dtype)
        for key, item in sorted(items.items(), key=lambda kv: (kv[0].fused, kv[0].shard, kv[0].attr)):
            layer = getattr(built, key.fused)
            layer.load(key.shard, key.attr, item.tensor if isinstance(item, MappedTensor) else item)
        for module in built.modules():
            if isinstance(module, LinearLayer):
                module.process_after_loading()
        built.requires_grad_(False)
        return built

    @staticmethod
    def _mapped_source(template: nn.Module, items: dict[_ExpertTensor, Item]) -> ExpertSource:
        """A dense expert straight from the checkpoint: each tensor fills its shard's rows."""
        copies = []
        for key, item in items.items():
            assert isinstance(item, MappedTensor)
            layer = getattr(template, key.fused)
            dst = f"{key.fused}.{key.attr}"
            rows = layer.output_sizes[key.shard]
            expected = (rows, *slot_tensors(template)[dst].shape[1:])
            if tuple(item.tensor.shape) != expected:
                raise ValueError(f"expert tensor of shape {tuple(item.tensor.shape)}, expected {expected}")
            copies.append(TensorCopy(dst, layer.shard_offset(key.shard), item.tensor, item))
        return ExpertSource(tuple(copies))

    # ---- after loading

    def finish(self, model: CausalLM) -> None:
        if self.collected:
            (layer, expert), items = next(iter(self.collected.items()))
            raise ValueError(
                f"checkpoint is missing weights of expert {expert} in layer {layer} "
                f"(found {len(items)} of {self.expected} tensors)"
            )
        if self.spill is not None:
            spilled = self.spill.sources()
            for (layer, expert), index in self.spilled.items():
                self.sources[layer][expert] = spilled[index]
        transfers, stats = ExpertTransfers(self.device), ExpertStats()
        cost = self._cpu_cost(next(iter(self.templates.values()))) if self.options.cpu_compute else None
        layers: list[OffloadedExperts] = []
        for index in sorted(self.blocks):
            sources = self.sources[index]
            if any(s is None for s in sources):
                raise ValueError(f"checkpoint is missing experts of layer {index}")
            template = self.templates[index]
            slots = [template] + [copy.deepcopy(template) for _ in range(self.cache_size + 1)]
            cpu = None if cost is None else (copy.deepcopy(template).to("cpu"), cost)
            offloaded = OffloadedExperts(
                slots,
                [s for s in sources if s is not None],
                ExpertCache(self.cache_size, make_policy(self.options.policy)),
                transfers,
                stats,
                self.options.stream_threshold_for(self.device.type, self.num_experts, self.cache_size),
                cpu,
                bind=self.device.type == "cpu" and self.options.mode == "host",
            )
            offloaded.prefetch_enabled = self.options.prefetch
            self.blocks[index].offload = offloaded
            layers.append(offloaded)
        ordered = [self.blocks[i] for i in sorted(self.blocks)]
        for current, following in zip(layers, ordered[1:]):
            current.next_layer = (following.offload, following.route)  # type: ignore[assignment]
        for file in self.files:
            file.release()  # the non-expert tensors were copied out
        if self.device.type == "cpu" and self.options.mode == "host":
            logger.warning(
                "expert_offload=host on a CPU device keeps every expert in the same memory the model "
                "computes from, so it saves no memory; expert_offload=disk does"
            )

    def _cpu_cost(self, template: nn.Module) -> CpuComputeCost:
        assert isinstance(template, MLP)
        source = self.sources[min(self.sources)][0]
        assert source is not None
        tensors, cpu = slot_tensors(template), copy.deepcopy(template).to("cpu")
        hidden = template.gate_up_proj.in_features

        def copy_one() -> None:
            source.copy_into(tensors, non_blocking=True)
            torch.cuda.synchronize(self.device)

        def run_cpu(tokens: int) -> None:
            cpu(torch.zeros(tokens, hidden, dtype=self.dtype)).to(self.device)
            torch.cuda.synchronize(self.device)

        return measure(copy_one, run_cpu)
