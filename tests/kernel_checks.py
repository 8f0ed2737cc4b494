"""Helpers the kernel tests share: relative error, seeded generators, poisoned outputs."""
from __future__ import annotations

import pytest
import torch

cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# Where the kernel tests put their tensors: a GPU when there is one (the kernels compile
# for real), else the CPU, where conftest.py turns the Triton interpreter on.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64."""
    assert out.shape == ref.shape
    out, ref = out.double(), ref.double()
    return float((out - ref).norm() / ref.norm())


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def poisoned(m: int, n: int, dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """An output pre-filled with NaN, so an element a kernel never writes fails."""
    return torch.full((m, n), float("nan"), dtype=dtype, device=device)
