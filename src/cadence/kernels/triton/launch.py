"""What the matmul kernels' entry points share: where Triton can run, [..., K] inputs, and
how a split-K launch fills the GPU."""

from __future__ import annotations

import functools
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


# The tiled W8A16/W4A16 GEMMs at decode M (up to 64 rows, one M block). Without a split,
# Llama-8B's o_proj and down_proj (N = 4096, BLOCK_N 64 or 128) are 32-64 programs: most
# of an H100's 132 SMs sit idle and each program walks all of K alone. The split aims for
# two programs per SM, one full wave. On an H100 it made int8 about twice as fast at
# M = 3-16 (bench/gpu_kernels.py's "unsplit" columns); the target of two per SM has not been
# swept.
TILED_PROGRAMS_PER_SM = 2
# Each split writes its fp32 partials and the last program reads them back: 8 bytes per
# output element per split. They may add at most this share of the weight's own bytes.
SPLIT_TRAFFIC_SHARE = 0.25


def split_k_to_fill(n_blocks: int, k_tiles: int, num_sms: int, programs_per_sm: int) -> int:
    """How many K slices to split a launch of ``n_blocks`` programs into: enough programs
    for ``programs_per_sm`` on every SM, a power of two dividing the K tiles so every
    slice is whole tiles, at least two of them."""
    split = 1
    while n_blocks * split < programs_per_sm * num_sms and k_tiles % (2 * split) == 0 and k_tiles // (2 * split) >= 2:
        split *= 2
    return split


def tiled_split_k(
    m: int,
    m_blocks: int,
    n_blocks: int,
    k_tiles: int,
    weight_bytes_per_column: int,
    out: torch.Tensor,
    requested: int | None,
) -> int:
    """K slices for a tiled GEMM launch: ``requested``, or by default enough to fill the
    GPU (``split_k_to_fill``), fewer where the partials' traffic would pass
    ``SPLIT_TRAFFIC_SHARE`` of the weight bytes. Only a launch whose rows fit one M block
    splits (``split_k.store_tile`` sums one block), into an ``out`` with unit column
    stride; larger M has programs enough anyway."""
    splittable = m_blocks == 1 and out.stride(1) == 1
    if requested is not None:
        if requested < 1 or (requested > 1 and not splittable):
            raise ValueError(
                f"k_splits={requested}: a split needs one M block (got {m_blocks}) and an output "
                f"with unit column stride (got {out.stride(1)}); 1 turns it off"
            )
        return requested
    if not splittable:
        return 1
    split = split_k_to_fill(n_blocks, k_tiles, num_sms(out.device), TILED_PROGRAMS_PER_SM)
    while split > 1 and split * m * 8 > SPLIT_TRAFFIC_SHARE * weight_bytes_per_column:
        split //= 2
    return split


def num_sms(device: torch.device) -> int:
    """The GPU's SM count; CPU tensors (the interpreter) get a nominal 8, small but enough
    to exercise the split paths in tests."""
    return _sm_count(_cuda_index(device)) if device.type == "cuda" else 8


def has_fp8_hardware(device: torch.device) -> bool:
    """Whether the GPU has fp8 arithmetic (compute capability 8.9+): ``_scaled_mm`` and
    Triton's e4m3 type need it."""
    return device.type == "cuda" and _capability(_cuda_index(device)) >= (8, 9)


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


# Both are asked on every kernel launch; the answers never change for a device.
@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)
