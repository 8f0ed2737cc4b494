"""What the matmul kernels' entry points share: where Triton can run, and [..., K] inputs."""
from __future__ import annotations

import os

import torch


def triton_usable(x: torch.Tensor) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors only in its interpreter (tests)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def check_activations(x: torch.Tensor) -> None:
    if x.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        raise TypeError(f"activations must be fp16/bf16/fp32, got {x.dtype}")


def as_rows(x: torch.Tensor, n: int, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """x [..., K] as rows [M, K], an output [M, N] (given or new), and the leading shape."""
    lead = tuple(x.shape[:-1])
    rows = x.reshape(-1, x.shape[-1])
    if out is None:
        out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
    return rows, out, lead
