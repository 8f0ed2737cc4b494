"""How much host memory a loaded model's weights take: what the CPU KV cache's size leaves
aside for them (kv_cache_size.kv_cache_budget_bytes).

A fact of the model and the options it was loaded with, the same at every start: the
distinct CPU storages behind the parameters and buffers (a tied embedding counts once),
and behind offloaded experts kept in host memory. Experts read from memory-mapped files
count nothing: their pages are the page cache's, released after each copy. The copies CPU
kernels keep (engine/quantization/cpu_planner.py) are not counted; they have a share of
the machine of their own. Weights packed for bf16dot in place of the dense ones (the CPU's
bf16 precision, engine/quantization/dense_dot.py) are the weights, and count.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn

from cadence.engine.experts.offloaded import OffloadedExperts
from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.quantization.linear_layer import DenseMethod, LinearLayer
from cadence.kernels.cpu.bf16_dot import DotWeight


def host_weights_bytes(model: CausalLM | nn.Module) -> int:
    """Bytes of host memory behind the model's weights (see the module doc)."""
    host: dict[int, int] = {}  # storage address -> bytes
    mapped: set[int] = set()

    def add(tensor: torch.Tensor) -> None:
        if tensor.device.type == "cpu":
            storage = tensor.untyped_storage()
            host[storage.data_ptr()] = storage.nbytes()

    for module in model.modules():
        for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            add(tensor)
        # A dense layer's packed weight replaces its weight (a quantized layer's is the
        # planner's copy, not counted).
        dense = isinstance(module, LinearLayer) and type(module.method) is DenseMethod
        for packed in (getattr(module, "cpu_dot", None) if dense else None, getattr(module, "cpu_head_dot", None)):
            if isinstance(packed, DotWeight):
                host[packed.blocks.ctypes.data] = packed.blocks.nbytes
        if isinstance(module, OffloadedExperts):
            for source in module.sources:
                for copy in source.copies:
                    if copy.mapped is None:
                        add(copy.src)
                    else:
                        mapped.add(copy.src.untyped_storage().data_ptr())
    # A slot bound to a mapped expert computes from the file's pages.
    return sum(nbytes for address, nbytes in host.items() if address not in mapped)
