"""A dense linear whose rows do not depend on the batch: ``invariant_linear(x, weight, bias)``.

A BLAS GEMM picks its blocking, and with it the order of each output's sum over K, from
the number of rows M: on CPU, a row of ``F.linear`` can read differently at M = 1, at a
few rows and at many, and for some shapes at particular M only. Greedy decoding must not
depend on what else runs in the step, so this runs every GEMM at one of a few row counts
(tile sizes) that were checked, on this machine, to give every row the same bits: at
each tile size, at each position inside a tile, at another memory offset, and at every
other tile size of the set. M is split into such tiles and the last one padded with
zero rows. Which sizes agree is BLAS-internal, so it is measured once per weight shape
(dtype, bias, thread count) and cached, never assumed. When no size passes the check,
the product is taken one K column at a time with separate multiplies and adds, whose
order is fixed by construction (and which is slow).

Plain torch, no triton: the CPU's path.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

logger = logging.getLogger(__name__)

# Candidate tile row counts. Larger tiles run prefill near full GEMM speed; the smallest
# verified one bounds what a batch-1 decode pays for padding. 15 and 16: BLAS often
# changes kernels between them.
TILE_LADDER = (1, 2, 4, 8, 15, 16, 32, 64, 128)


@dataclass(frozen=True)
class TilePlan:
    """The verified tile sizes of one weight shape, ascending; empty means the fixed-order
    fallback."""

    sizes: tuple[int, ...]

    def tiles(self, m: int) -> list[tuple[int, int]]:
        """(rows taken from the input, rows the GEMM runs at) per tile, covering ``m`` rows:
        the largest size as often as it fits, then the largest that fits the rest, and a
        last short tile padded up to the smallest size."""
        out: list[tuple[int, int]] = []
        rest = m
        while rest > 0:
            fitting = [s for s in self.sizes if s <= rest]
            size = fitting[-1] if fitting else self.sizes[0]
            out.append((min(size, rest), size))
            rest -= size
        return out


@dataclass(frozen=True)
class _ShapeKey:
    out_features: int
    in_features: int
    dtype: torch.dtype
    device: str
    has_bias: bool
    num_threads: int


_plans: dict[_ShapeKey, TilePlan] = {}


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` whose every row has the bits it would have alone."""
    k = x.shape[-1]
    rows = x.reshape(-1, k).contiguous()
    plan = tile_plan(weight, bias)
    if not plan.sizes:
        out = ordered_linear(rows, weight, bias)
    else:
        out = run_tiles(rows, plan, lambda tile: F.linear(tile, weight, bias))
    return out.view(*x.shape[:-1], weight.shape[0])


def run_tiles(
    rows: torch.Tensor,
    plan: TilePlan,
    gemm: Callable[[torch.Tensor], torch.Tensor],
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``gemm(rows)`` run at the plan's tile sizes, the last tile padded with zero rows, in
    ``out_dtype`` (default: the GEMM's own). Each tile is written into the output as it
    comes, converted on the way: one pass over the result, not a cast and a concatenation."""
    m = rows.shape[0]
    if m in plan.sizes:  # one whole tile, the usual decode step: no views or copies around it
        whole = gemm(rows)
        return whole if out_dtype is None else whole.to(out_dtype)
    if m == 0:  # no rows: the GEMM's output shape, from one tile of padding
        rows = rows.new_zeros(plan.sizes[0], rows.shape[1])
        empty = gemm(rows)[:0]
        return empty if out_dtype is None else empty.to(out_dtype)
    tiles = plan.tiles(m)
    out: torch.Tensor | None = None
    start = 0
    for taken, size in tiles:
        tile = rows[start : start + taken]
        if taken < size:
            tile = F.pad(tile, (0, 0, 0, size - taken))
        part = gemm(tile)[:taken]
        if len(tiles) == 1:
            return part if out_dtype is None else part.to(out_dtype)
        if out is None:
            out = torch.empty(m, part.shape[1], dtype=out_dtype or part.dtype, device=part.device)
        out[start : start + taken] = part
        start += taken
    assert out is not None  # two tiles or more
    return out


def tile_plan(weight: torch.Tensor, bias: torch.Tensor | None = None) -> TilePlan:
    """The cached plan for this weight's shape, measured on first use."""
    key = _ShapeKey(
        weight.shape[0], weight.shape[1], weight.dtype, str(weight.device), bias is not None, torch.get_num_threads()
    )
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = measure_tile_plan(
            key.out_features, key.in_features, weight.dtype, weight.device, key.has_bias
        )
        if not plan.sizes:
            logger.warning(
                "no GEMM tile size keeps rows batch-invariant for a %dx%d %s weight; "
                "using the slow fixed-order product",
                key.out_features,
                key.in_features,
                weight.dtype,
            )
    return plan


def measure_tile_plan(
    out_features: int, in_features: int, dtype: torch.dtype, device: torch.device | str, has_bias: bool
) -> TilePlan:
    """``measure_tiles`` for ``F.linear`` on ``cancellation_probe``'s weight and inputs (and
    a random bias) of this shape."""
    dense, inputs = cancellation_probe(out_features, in_features, dtype)
    weight = dense.to(dtype=dtype, device=device)
    gen = torch.Generator().manual_seed(0)
    bias = torch.randn(out_features, generator=gen).to(dtype=dtype, device=device) if has_bias else None
    return measure_tiles(lambda x: F.linear(x, weight, bias), in_features, dtype, device, inputs)


def measure_tiles(
    gemm: Callable[[torch.Tensor], torch.Tensor],
    in_features: int,
    dtype: torch.dtype,
    device: torch.device | str,
    inputs: torch.Tensor | None = None,
) -> TilePlan:
    """Which ladder sizes give every row of ``gemm`` (a product with a fixed weight) the same
    bits, on ``inputs`` (at least ``TILE_LADDER[-1] + 3`` rows; random by default).

    At each size, the tile is run at offset 0 and again one and three rows further on
    (each of those also from a fresh copy), so every row is seen at two neighbouring
    positions and at other memory alignments; a size whose rows move is dropped. The
    rest fall into classes by the bits of their common rows, and the class whose tiling
    costs least over decode and prefill batch sizes wins (``_modelled_cost``).
    """
    if inputs is None:
        gen = torch.Generator().manual_seed(1)
        inputs = torch.randn(TILE_LADDER[-1] + 3, in_features, generator=gen)
    x = inputs.to(dtype=dtype, device=device)
    results: dict[int, torch.Tensor] = {}
    for size in TILE_LADDER:
        at_zero = gemm(x[:size])
        steady = True
        for shift in (1, 3):
            view = x[shift : shift + size]
            moved = gemm(view)
            steady &= torch.equal(moved, gemm(view.clone()))  # another alignment
            steady &= torch.equal(moved[: max(size - shift, 0)], at_zero[shift:])  # another position
        if steady:
            results[size] = at_zero
    classes: list[list[int]] = []
    for size, rows in results.items():
        for members in classes:
            first = members[0]  # the smaller size: its rows are the common ones
            if torch.equal(results[first], rows[:first]):
                members.append(size)
                break
        else:
            classes.append([size])
    if not classes:
        return TilePlan(())
    plans = [TilePlan(tuple(members)) for members in classes]
    costs = [[_modelled_cost(plan, m) for m in _RANKED_ROWS] for plan in plans]
    best = [min(column) for column in zip(*costs)]
    # Each batch size counts relative to the best plan for it, so batch 1 weighs as much
    # as a long prefill.
    return min(zip(plans, costs), key=lambda pc: sum(c / b for c, b in zip(pc[1], best)))[0]


def cancellation_probe(
    out_features: int, in_features: int, weight_dtype: torch.dtype, seed: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp32 weight (exact in ``weight_dtype`` where it matters) and inputs under which a
    change in a GEMM's summation order shows even through an output rounded to few bits
    (bf16's 8): every 8th input column is 1, and each weight row has ``+big`` and ``-big``
    at two of those columns, so the exact sum is the random terms alone while a running
    fp32 sum holds ``big`` between the two, and rounds the terms added meanwhile to
    ``big``'s coarse steps. Where the order differs, different terms are so rounded, and
    the outputs differ by far more than the output's own rounding. (Random inputs alone
    only show an order change where an exact sum happens to lie near a rounding boundary.)"""
    big = 2.0**15 if weight_dtype == torch.float16 else 2.0**20  # within fp16's range
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=gen)
    inputs = torch.randn(TILE_LADDER[-1] + 3, in_features, generator=gen)
    columns = torch.arange(0, in_features, 8)
    inputs[:, columns] = 1.0
    first, second = (columns[torch.randint(0, len(columns), (out_features,), generator=gen)] for _ in range(2))
    rows = torch.arange(out_features)[first != second]
    weight[rows, first[first != second]] = big
    weight[rows, second[first != second]] = -big
    return weight, inputs


# Batch sizes the plans are ranked on, each counting as much as the others: batch-1
# decode, the batched decodes of a loaded server, and prefill chunks. Weighting small
# batches more picked tiles of under 16 rows, which slowed batched decode and prefill
# more than larger tiles slow batch 1 (bench/RESULTS.md, "Batch-invariant CPU linears").
_RANKED_ROWS = (1, 16, 64, 256, 2048)
# What a GEMM call costs beyond its rows, in rows (reading the weight once). A modelled
# figure rather than a timing, so the choice does not change with the machine's load.
_CALL_COST_ROWS = 32


def _modelled_cost(plan: TilePlan, m: int) -> int:
    return sum(size + _CALL_COST_ROWS for _, size in plan.tiles(m))


def ordered_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T + bias`` summed over K in index order, every product and sum rounded
    on its own: no reduction kernel is involved, so no row depends on another."""
    out = torch.zeros(x.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    columns = weight.t()
    for k in range(x.shape[1]):
        out.add_(x[:, k : k + 1] * columns[k])
    if bias is not None:
        out.add_(bias)
    return out
