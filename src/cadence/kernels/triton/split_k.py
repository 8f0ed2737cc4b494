"""Split-K without atomics on the output: one launch, deterministic.

A decode GEMV splits K across programs to keep enough loads in flight. Adding the
slices with fp32 atomics needs a zeroed buffer and a cast afterwards (three launches),
and the sum's order changes from run to run. Instead each program writes its fp32
partial to a workspace ``[num_splits, M, N]``, takes a ticket for its column block, and
the last one to arrive sums the partials in split order and writes the output. Tickets
live in one per-device buffer of counters that the last program re-arms to zero, so
launches on one stream (the engine's) can share it, CUDA graphs included.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

MAX_COLUMN_BLOCKS = 1 << 14


@functools.cache
def counters(device: torch.device) -> torch.Tensor:
    """The device's ticket counters, one per column block, all zero between launches."""
    return torch.zeros(MAX_COLUMN_BLOCKS, dtype=torch.int32, device=device)


def workspace(num_splits: int, m: int, n: int, n_blocks: int, out: torch.Tensor) -> torch.Tensor:
    """fp32 partials for a split launch (``out`` itself, unused, when there is one slice)."""
    if num_splits == 1:
        return out
    assert n_blocks <= MAX_COLUMN_BLOCKS, "a split launch has few column blocks"
    return torch.empty((num_splits, m, n), dtype=torch.float32, device=out.device)


@triton.jit
def _last_to_arrive(counter_ptr, pid_n, num_splits):
    """Every program of column block ``pid_n`` calls this after storing its partials;
    True in the one that arrives last, which then sees all of them."""
    tl.debug_barrier()  # every thread's partial is stored before the release below
    ticket = tl.atomic_add(counter_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    return ticket == num_splits - 1


@triton.jit
def finish(
    ws_ptr,
    counter_ptr,
    out_ptr,
    stride_om,
    pid_n,
    offs_n,
    mask_n,
    M,
    N,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """For the GEMVs (M <= BLOCK_M <= 4, any M): after storing its rows
    ``ws[pid_k, m, offs_n]``, the last program of column block ``pid_n`` writes
    ``out[m, offs_n]`` for the M rows, one row at a time."""
    if _last_to_arrive(counter_ptr, pid_n, num_splits):
        for m in tl.static_range(BLOCK_M):
            if m < M:
                total = tl.zeros([BLOCK_N], tl.float32)
                for j in range(num_splits):
                    total += tl.load(ws_ptr + (j * M + m) * N + offs_n, mask=mask_n, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + m * stride_om + offs_n, total.to(out_ptr.dtype.element_ty), mask=mask_n)
        tl.atomic_xchg(counter_ptr + pid_n, 0)


@triton.jit
def store_tile(
    acc,
    ws_ptr,
    counter_ptr,
    out_ptr,
    stride_om,
    stride_on,
    pid_k,
    pid_n,
    offs_m,
    offs_n,
    mask_m,
    mask_n,
    M,
    N,
    num_splits,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """The tiled GEMMs' epilogue: the fp32 ``[BLOCK_M, BLOCK_N]`` tile ``acc`` straight to
    ``out``, or, with SPLIT (one M block only), as K slice ``pid_k``'s partial. The last
    program of the column block then reads each split's whole tile at once, so its wait is
    ``num_splits`` round trips to L2, not M times that as in ``finish``."""
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT:
        tile = offs_m[:, None] * N + offs_n[None, :]
        tl.store(ws_ptr + pid_k * M * N + tile, acc, mask=mask)
        if _last_to_arrive(counter_ptr, pid_n, num_splits):
            total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for j in range(num_splits):
                total += tl.load(ws_ptr + j * M * N + tile, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(
                out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], total.to(out_ptr.dtype.element_ty), mask=mask
            )
            tl.atomic_xchg(counter_ptr + pid_n, 0)
    else:
        out = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
