"""Each quantized layer's CPU kernel, chosen by rule: a model's numerics never follow a timing.

The kernels of ``kernels/cpu/kernel_names.py`` each give bits of their own, so which one a layer runs
decides every answer the model gives. The choice is therefore a rule of the weight format,
``--cpu-kernels`` and the CPU's instruction set, and never a measurement: timings taken
while other work runs on the machine would otherwise decide, once and for every later
start, what the model answers.

``--cpu-kernels`` (``EngineArgs.cpu_kernels``):

* ``auto`` (default): each layer runs the first kernel of ``AUTO_ORDER`` it can run here,
  which is the finest arithmetic the CPU makes fast:

  - ``bf16dot`` on CPUs with AVX512-BF16 (bf16 products summed in fp32);
  - ``fp16`` on builds with fbgemm (fp16 weights, fp32 arithmetic: the dense model's answers);
  - ``dense``, a kept fp32 copy;
  - ``packed`` (bf16 activations), for weights no copy may be made of;
  - ``dequant``, the dense copy made per call.

  A kernel that keeps a copy runs only while every copy fits ``DENSE_MEMORY_FRACTION`` of
  the machine's memory (its total, or its cgroup's limit: a fact of the machine, not of
  the moment), so a quantized model that would not fit dense stays quantized; weights a
  format refuses (a value beyond fp16's range, a shape no tile size keeps invariant) pass
  to the next kernel. The half and integer kernels take fp32 activations only.
* ``packed``, ``dequant``, ``dense``, ``fp16``, ``bf16``, ``bf16dot``, ``int8x2dot``,
  ``int8dot``: that kernel everywhere it runs, its copy made whatever the memory, and
  ``auto``'s choice for a group that does not run it (the int8 LM head under an int4
  kernel). The integer kernels run only so: ``int8dot`` is llama.cpp's arithmetic for
  4-bit blocks (activations rounded to int8 per block of 32: it changes some greedy
  tokens), ``int8x2dot`` the same with two int8 levels (bench/RESULTS.md measures both).

Every kernel sums a row in one order that its batch does not change, so a layer's one
kernel keeps greedy output batch invariant.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from cadence.engine.machine_memory import total_host_memory
from cadence.engine.quantization.linear import QuantizedMethod, dense_bytes
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.kernels.cpu import int8_dot
from cadence.kernels.cpu.half_linear import FORMATS, available
from cadence.kernels.cpu.kernel_names import (
    BF16DOT,
    DENSE,
    DEQUANT,
    FP16,
    HALF_KERNELS,
    HELD_KERNELS,
    INT_DOT_LEVELS,
    PACKED,
    validate_cpu_kernels,
)

logger = logging.getLogger(__name__)

# What ``auto`` runs: the first of these a layer's format, this CPU and the memory allow.
AUTO_ORDER = (BF16DOT, FP16, DENSE, PACKED, DEQUANT)
# Kernels that run only where ``--cpu-kernels`` names them (and are never compiled otherwise).
OPT_IN_KERNELS = tuple(INT_DOT_LEVELS)
DENSE_MEMORY_FRACTION = 0.25  # of the machine's memory, for every kept copy together


@dataclass
class LayerGroup:
    """Layers of one format and shape: they run the same kernel, chosen once."""

    key: str
    method: QuantizedMethod
    layers: list[LinearLayer]
    kernels: tuple[str, ...]

    def held_bytes(self, kernel: str, dtype: torch.dtype) -> int:
        """The memory ``kernel``'s kept copies take for the whole group (0 for a kernel
        that keeps none; packed half copies are padded to their GEMM's blocks)."""
        layer = self.layers[0]
        if kernel not in HELD_KERNELS:
            return 0
        if kernel in INT_DOT_LEVELS:
            return len(self.layers) * int8_dot.packed_bytes(layer.out_features, layer.in_features)
        if kernel not in HALF_KERNELS:
            return len(self.layers) * dense_bytes(layer, dtype)
        bounds = self.method.chunk_bounds(layer)
        packed_bytes = FORMATS[kernel].packed_bytes
        return len(self.layers) * sum(packed_bytes(stop - start, layer.in_features) for start, stop in bounds)

    def hold(self, kernel: str, dtype: torch.dtype) -> None:
        for layer in self.layers:
            if kernel in HALF_KERNELS:
                self.method.hold_half(layer, kernel)
            elif kernel in INT_DOT_LEVELS:
                self.method.hold_int_dot(layer, kernel)
            elif kernel == DENSE:
                self.method.hold_dense(layer, dtype)

    def drop(self, kernel: str) -> None:
        for layer in self.layers:
            if kernel in HALF_KERNELS:
                self.method.drop_half(layer, kernel)
            elif kernel in INT_DOT_LEVELS:
                self.method.drop_int_dot(layer, kernel)
            elif kernel == DENSE:
                self.method.drop_dense(layer)


def layer_groups(modules: Iterable[nn.Module], dtype: torch.dtype, mode: str = "auto") -> list[LayerGroup]:
    """The model's CPU-quantized layers that have a choice of kernels, grouped by format and
    shape, each with the kernels it may run here. An ``OPT_IN_KERNELS`` kernel is among them
    only where ``mode`` names it."""
    members: dict[tuple[str, int, int, int | None, bool], LayerGroup] = {}
    for module in modules:
        if not isinstance(module, LinearLayer) or not isinstance(module.method, QuantizedMethod):
            continue
        # The half and integer kernels take fp32 activations, and run where their GEMM does;
        # no kernel keeps a copy of weights that a load replaces (an offloaded expert's slot).
        kernels = tuple(
            k
            for k in module.method.cpu_kernels(module)
            if (k not in OPT_IN_KERNELS or k == mode)  # first: asking the hardware compiles
            and (k not in HELD_KERNELS or module.weights_fixed)
            and (k not in HALF_KERNELS or (dtype == torch.float32 and available(FORMATS[k])))
            and (k not in INT_DOT_LEVELS or (dtype == torch.float32 and int8_dot.hardware_ready()))
        )
        if len(kernels) > 1:
            fmt = type(module.method).__name__.removesuffix("Method").lower()
            shape = (fmt, module.out_features, module.in_features, getattr(module, "cpu_group_size", None))
            key = (*shape, module.weights_fixed)
            members.setdefault(key, LayerGroup("", module.method, [], kernels)).layers.append(module)
    for (fmt, n, k, group_size, _), entry in members.items():
        group = "" if group_size is None else f" g{group_size}"
        entry.key = f"{fmt} {n}x{k}{group} {str(dtype).removeprefix('torch.')} x{len(entry.layers)}"
    return list(members.values())


def plan_cpu_kernels(modules: Iterable[nn.Module], dtype: torch.dtype, mode: str = "auto") -> None:
    """Give every CPU-quantized layer among ``modules`` (activations in ``dtype``) its kernel
    by the rule above, make the copy it reads, and log what each group runs."""
    mode = validate_cpu_kernels(mode)
    budget = int(total_host_memory() * DENSE_MEMORY_FRACTION)
    for group in layer_groups(modules, dtype, mode):
        named = mode if mode in group.kernels else None
        kernel = named if named is not None and _try_hold(group, named, dtype) else None
        if kernel is None:
            order = [k for k in _auto_order(group) if k != named]  # a named kernel refused is not tried twice
            fitting = (k for k in order if _fits(group, k, dtype, budget) and _try_hold(group, k, dtype))
            kernel = next(fitting, None)
        if kernel is None:  # every format offers a kernel without a copy; this would be a bug
            raise RuntimeError(f"no CPU kernel of {group.kernels} runs {group.key}")
        held = group.held_bytes(kernel, dtype)
        if named is None:
            budget -= held  # a named kernel's copy is the user's choice, outside the budget
        for layer in group.layers:
            layer.cpu_kernel = kernel
        memory = f", kept copy {held / 2**20:.0f} MiB" if held else ""
        how = "as --cpu-kernels names" if kernel == named else "auto: the finest this CPU runs fast"
        logger.info("CPU kernel for %s: %s (%s%s)", group.key, kernel, how, memory)


def _auto_order(group: LayerGroup) -> list[str]:
    """The group's kernels, those of ``AUTO_ORDER`` first and in its order."""
    return [k for k in AUTO_ORDER if k in group.kernels] + [k for k in group.kernels if k not in AUTO_ORDER]


def _fits(group: LayerGroup, kernel: str, dtype: torch.dtype, budget: int) -> bool:
    return group.held_bytes(kernel, dtype) <= budget


def _try_hold(group: LayerGroup, kernel: str, dtype: torch.dtype) -> bool:
    """Make the group's copies for ``kernel``; where its weights cannot take them (a half
    kernel: values beyond fp16's range, or no invariant tiling), drop any made and say no."""
    try:
        group.hold(kernel, dtype)
    except (ValueError, RuntimeError) as exc:
        group.drop(kernel)
        logger.info("CPU kernels for %s: no %s (%s)", group.key, kernel, exc)
        return False
    return True


def group_summary(modules: Iterable[nn.Module]) -> dict[str, int]:
    """How many layers run each kernel (for tests and reports)."""
    counts: dict[str, int] = defaultdict(int)
    for module in modules:
        if isinstance(module, LinearLayer) and module.cpu_kernel is not None:
            counts[module.cpu_kernel] += 1
    return dict(counts)
