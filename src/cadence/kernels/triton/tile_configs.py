"""Launch configurations of the tiled W8A16 and W4A16 GEMMs, by the number of rows M.

Chosen from ``bench/tune_tiled.py`` on an H100 (bf16, Llama-8B's four projections summed,
CUDA-graph replays; ``git show 90ba143:bench/HISTORY.md`` has the sweep). What it found, in order of effect:

* BLOCK_K 128 instead of 64: half the loop trips and twice the bytes in flight per step.
  W8A16 at M = 2-16 went from 113-163 µs to 96-99 (dense bf16: 164), which also beats its
  GEMV at M = 2 (163 µs), so int8 has no GEMV any more.
* W4A16 loading each packed int32 once and spreading its nibbles in registers
  (``words_once``, on in ``w4a16.py``; the fused MoE kernel still loads per K row)
  instead of eight loads of the same word: the best configuration at every M used it.
* Larger tiles from 64 rows (64 x 64, then 128 x 64); the untuned 64 x 64 x 64 tile was
  0.16x dense for int4 at M = 256, the configuration below 0.46x.

The table's rows were measured at M = 2, 4, 16, 64 and 256 (bf16); the 17-32 row and
the M between measured points follow their neighbours untested, and other GPUs and fp16
are untested (fp16 timed 7-50% slower with the same tiles on the H100, not explained). A
batch-invariant launch must not change its tile with M (BLOCK_K orders the sum), so it
keeps ``INVARIANT`` whatever M is.
"""

from __future__ import annotations

from dataclasses import dataclass

from cadence.kernels.batch_invariant.triton_gemm import BLOCK_M as INVARIANT_BLOCK_M


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Batch-invariant launches: the batch-invariant dense GEMM's row tile, and the N and K
# tiles every M took before the sweep.
INVARIANT = TileConfig(INVARIANT_BLOCK_M, 64, 64)

_W8A16 = (
    (16, TileConfig(16, 64, 128)),  # 96-99 µs at M = 2-16 (8 warps: within 1%)
    (32, TileConfig(32, 64, 128)),  # not measured: the 16- and 64-row tiles both like BLOCK_K 128
    (128, TileConfig(64, 64, 128)),  # 144 µs at M = 64 (1.18x dense)
    (None, TileConfig(128, 64, 64, num_warps=8)),  # 386 µs at M = 256 (0.53x dense)
)
_W4A16 = (
    (16, TileConfig(16, 128, 128)),  # 122-123 µs at M = 4-16 (1.33-1.36x dense)
    (32, TileConfig(32, 64, 128)),  # not measured
    (128, TileConfig(64, 64, 128)),  # 182 µs at M = 64 (0.93x dense)
    (None, TileConfig(128, 64, 128)),  # 441 µs at M = 256 (0.46x dense)
)


def _pick(table: tuple[tuple[int | None, TileConfig], ...], m: int) -> TileConfig:
    for max_m, config in table:
        if max_m is None or m <= max_m:
            return config
    raise AssertionError("the last row of a table has no bound")


def w8a16_tile(m: int) -> TileConfig:
    return _pick(_W8A16, m)


def w4a16_tile(m: int) -> TileConfig:
    return _pick(_W4A16, m)
