"""Which attention backend a device gets: Triton on CUDA, torch everywhere else."""

from __future__ import annotations

import os

import torch

from cadence.engine.attention.backend import AttentionBackend, AttentionSpec
from cadence.engine.attention.torch_sdpa import TorchSDPABackend

ATTENTION_BACKENDS = ("auto", "torch", "triton")


def create_attention_backend(
    name: str,
    spec: AttentionSpec,
    block_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    *,
    batch_invariant: bool = False,
) -> AttentionBackend:
    """`auto` picks Triton on CUDA and torch SDPA on CPU; `torch` / `triton` force one.

    Triton on CPU tensors only runs in Triton's interpreter (TRITON_INTERPRET=1), which
    is how the tests exercise it; it is far too slow to serve with. ``dtype`` is the
    model's (the torch backend's CPU path measures its batch-invariant shapes for it).
    `batch_invariant` asks the Triton backend for batch-invariant attention; on CUDA the
    torch backend has none (SDPA picks its kernel by shape), so it is refused there.
    """
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; use one of {ATTENTION_BACKENDS}")
    if name == "auto":
        name = "triton" if device.type == "cuda" else "torch"
    if name == "torch":
        if batch_invariant and device.type == "cuda":
            raise ValueError("batch_invariant on CUDA needs the triton attention backend, not torch")
        return TorchSDPABackend(spec, block_size, dtype)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError("the Triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 in tests)")
    # Imported here: triton is only needed where this backend runs.
    from cadence.engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend(spec, block_size, batch_invariant=batch_invariant)
