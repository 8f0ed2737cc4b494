"""Generated tokens' attention on CPU, read straight from the paged cache.

torch has no paged attention on CPU, so the SDPA path (``torch_sdpa``) first copies each
decode's blocks into one padded tensor, per layer, and SDPA then reads that copy back:
every key and value crosses memory three times, and the small per-row GEMMs inside the
flash kernel cost more than their arithmetic. This kernel walks each row's block table itself, one task per row, block
by block: the scores of every query head against its KV head's keys, a softmax, and the
weighted sum of the values, each key and value read once (a slot's KV heads lie side by
side, so each block is one contiguous read).

It is compiled by numba (LLVM) on first use and cached on disk, and runs on as many
threads as torch uses, serially in a process forked after it ran
(``kernels/cpu/numba_runtime.py``); where numba cannot build it (or its OpenMP threading
layer cannot load: no system ``libgomp``), ``available`` is false and every row stays on
SDPA.

Batch invariance: a row's arithmetic depends only on its own query, keys and length (the
loops' trip counts), never on the other rows, and every call runs the same compiled code
(the arguments always have the same types and layouts, so numba never specialises
again). A process forked from one running numba's threads runs the serial form, compiled
apart from the parallel one: LLVM may vectorize its sums otherwise, so such a child's bits
may differ from its parent's, but every row in it is still computed alone.

The kernel's bits differ from SDPA's, so a token's attention must not switch between the
two with its batch: the backend runs this kernel for the rows of generated tokens
(positions from the prompt's length on), in decode steps and in a recomputed prefill
alike, and SDPA for prompt tokens' rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from cadence.kernels.cpu.numba_runtime import NumbaKernel, prefetch_intrinsic


@dataclass(frozen=True)
class GeneratedRows:
    """The step's rows that hold generated tokens, and what each attends to (int32 arrays,
    built once per step for every layer)."""

    rows: np.ndarray  # [n] row of the flat batch
    tables: np.ndarray  # [n, max_blocks] the row's sequence's block ids
    lengths: np.ndarray  # [n] keys up to and including the row's own position
    starts: np.ndarray  # [n] the first key it sees (a sliding window's start, else 0)

    @staticmethod
    def build(rows: list[int], tables: torch.Tensor, positions: list[int], window: int | None) -> GeneratedRows:
        """Rows at ``positions`` of sequences whose block tables are ``tables`` (int32,
        one row per entry of ``rows``)."""
        lengths = np.asarray(positions, dtype=np.int32) + 1
        starts = np.maximum(lengths - window, 0).astype(np.int32) if window is not None else np.zeros_like(lengths)
        table = np.ascontiguousarray(tables.numpy(), dtype=np.int32)
        return GeneratedRows(np.asarray(rows, dtype=np.int32), table, lengths, starts)


def available() -> bool:
    """Whether the kernel can run here (numba imports and compiles it), compiling it on
    the first call; the reason it cannot is logged once."""
    return _kernel.function() is not None


def attend_generated(
    query: torch.Tensor,
    out: torch.Tensor,
    key_rows: torch.Tensor,
    value_rows: torch.Tensor,
    generated: GeneratedRows,
    block_size: int,
    scale: float,
) -> None:
    """Write the attention of ``generated.rows`` of ``query [T, heads, D]`` into the same
    rows of ``out``; ``key_rows`` / ``value_rows`` are a layer's cache as ``[slots, KV
    heads, D]``, all float32 and contiguous."""
    # C-contiguous arrays of fixed types only, so that every call runs the one compiled
    # specialization (another layout would compile, and might round, differently).
    target = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype)
    _kernel(
        query.contiguous().numpy(),
        key_rows.numpy(),  # a layer's cache: contiguous by construction
        value_rows.numpy(),
        generated.rows,
        generated.tables,
        generated.lengths,
        generated.starts,
        block_size,
        np.float32(scale),
        target.numpy(),
    )
    if target is not out:
        rows = torch.from_numpy(generated.rows).long()
        out[rows] = target[rows]


# The prefetch intrinsic, set by ``_build``: a module global, not a closure cell, so that
# numba's disk cache recognises the kernel in the next process.
_prefetch: Any = None


def _build(parallel: bool, cache: bool) -> Callable[..., None]:
    global _prefetch
    from numba import njit, prange

    _prefetch = prefetch_intrinsic()

    # fastmath lets LLVM vectorize the sums over the head dimension (in one fixed order per
    # compiled function); error_model numpy keeps divisions free of Python's checks.
    @njit(parallel=parallel, fastmath=True, nogil=True, error_model="numpy", cache=cache)
    def paged_decode(
        q: Any,
        k_cache: Any,
        v_cache: Any,
        rows: Any,
        tables: Any,
        lengths: Any,
        starts: Any,
        block_size: int,
        scale: Any,
        out: Any,
    ) -> None:  # pragma: no cover - compiled by numba; its tests call it
        heads, dim = q.shape[1], q.shape[2]
        group = heads // k_cache.shape[1]
        for i in prange(rows.shape[0]):
            row, first, end = rows[i], starts[i], lengths[i]
            scaled = np.empty((heads, dim), np.float32)
            for h in range(heads):
                for d in range(dim):
                    scaled[h, d] = q[row, h, d] * scale
            # Block by block (no division per key), each slot's KV heads together: they lie
            # side by side, so a block is one contiguous read.
            scores = np.empty((heads, end - first), np.float32)
            slot_floats = k_cache.shape[1] * k_cache.shape[2]
            last = (end - 1) // block_size
            for b in range(first // block_size, last + 1):
                offset = tables[i, b] * block_size - b * block_size  # slot = offset + position
                # The blocks lie anywhere in memory, so the hardware cannot guess the next:
                # a slot a token, the next block's keys and this block's values are asked
                # for ahead of their use (the values for the second pass below).
                has_next = b < last
                following = tables[i, b + 1] * block_size - (b + 1) * block_size if has_next else 0
                for t in range(max(first, b * block_size), min(end, (b + 1) * block_size)):
                    if has_next:
                        ahead = np.int64(following + t + block_size) * slot_floats
                        for line in range(0, slot_floats, 16):
                            _prefetch(k_cache, ahead + line)
                    here = np.int64(offset + t) * slot_floats
                    for line in range(0, slot_floats, 16):
                        _prefetch(v_cache, here + line)
                    for h in range(heads):
                        s = np.float32(0.0)
                        for d in range(dim):
                            s += scaled[h, d] * k_cache[offset + t, h // group, d]
                        scores[h, t - first] = s
            for h in range(heads):
                top = scores[h, 0]
                for t in range(1, end - first):
                    top = max(top, scores[h, t])
                total = np.float32(0.0)
                for t in range(end - first):
                    e = np.exp(scores[h, t] - top)
                    scores[h, t] = e
                    total += e
                inverse = np.float32(1.0) / total
                for t in range(end - first):
                    scores[h, t] *= inverse
            acc = np.zeros((heads, dim), np.float32)
            for b in range(first // block_size, (end - 1) // block_size + 1):
                offset = tables[i, b] * block_size - b * block_size
                for t in range(max(first, b * block_size), min(end, (b + 1) * block_size)):
                    for h in range(heads):
                        p = scores[h, t - first]
                        for d in range(dim):
                            acc[h, d] += p * v_cache[offset + t, h // group, d]
            for h in range(heads):
                for d in range(dim):
                    out[row, h, d] = acc[h, d]

    # Compile now, on arrays of the types every call passes, so that the first step does
    # not pay for it and a failure shows here.
    query = np.zeros((1, 1, 8), np.float32)
    rows = np.zeros((4, 1, 8), np.float32)
    one = np.ones(1, np.int32)
    table = np.zeros((1, 1), np.int32)
    paged_decode(query, rows, rows, one * 0, table, one, one * 0, 4, np.float32(1.0), query.copy())
    return paged_decode


_kernel = NumbaKernel("CPU paged decode", _build)
