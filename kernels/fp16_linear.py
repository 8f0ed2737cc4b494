"""A CPU linear with half-precision weights and fp32 arithmetic, rows batch-invariant.

fbgemm's fp16 GEMM (``torch.ops.quantized.linear_dynamic_fp16``) keeps the weight in fp16,
half the bytes of fp32, and converts it to fp32 in registers (F16C) to multiply and sum in
fp32: the scheme llama.cpp runs its f16 models with on x86. Decode at small batch is bound
by weight bytes and gains from the halving; at large batch its blocking also beats the
fp32 BLAS on some CPUs (bench/RESULTS.md, "CPU kernels the planner measured").

The weight's values are rounded to fp16 once (a quantized model's dequantized values,
whose own quantization error is far larger than fp16's rounding). Like a BLAS GEMM, the
kernel's sum order follows the number of rows, so calls run at tile sizes measured to
give every row the same bits (``batch_invariant.measure_tiles``), per weight shape and
thread count. Where fbgemm is missing (non-x86 builds) or no tile size verifies, the
kernel is not offered.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from cadence.kernels.batch_invariant import TilePlan, measure_tiles, run_tiles

logger = logging.getLogger(__name__)

FP16_MAX = 65504.0
# fbgemm packs the fp16 matrix in blocks of K rounded up to 512 and of N up to a column
# block (at most 32 wide): the bytes a packed weight takes, as budgets must count them.
_PACK_K, _PACK_N = 512, 32

_plans: dict[tuple[int, int, int], TilePlan] = {}
_available: bool | None = None


@dataclass(frozen=True)
class Fp16Weight:
    """A ``[N, K]`` weight prepacked for fbgemm's fp16 GEMM."""

    packed: object  # fbgemm's packed parameters (an opaque script object)
    out_features: int
    in_features: int


def fp16_gemm_available() -> bool:
    """Whether this torch build has fbgemm's fp16 GEMM (x86 builds do)."""
    global _available
    if _available is None:
        try:
            weight = pack_fp16(torch.ones(16, 16))
            _available = bool(torch.equal(_gemm(torch.ones(1, 16), weight), torch.full((1, 16), 16.0)))
        except (RuntimeError, AttributeError, NotImplementedError):
            _available = False
    return _available


def packed_fp16_bytes(out_features: int, in_features: int) -> int:
    """An upper bound on what ``pack_fp16`` of an ``[N, K]`` weight takes (about 1.8x N*K*2
    at K = 576)."""
    k = -(-in_features // _PACK_K) * _PACK_K
    n = -(-out_features // _PACK_N) * _PACK_N
    return n * k * 2


def fits_fp16(weight: torch.Tensor) -> bool:
    """Whether every value of ``weight`` is finite in fp16."""
    return bool(weight.abs().max() <= FP16_MAX) if weight.numel() else True


def pack_fp16(weight: torch.Tensor) -> Fp16Weight:
    """``weight`` (``[N, K]``, any float dtype) rounded to fp16 and packed."""
    dense = weight.detach().float().contiguous()
    packed = torch.ops.quantized.linear_prepack_fp16(dense, None)
    return Fp16Weight(packed, dense.shape[0], dense.shape[1])


def fp16_tile_plan(out_features: int, in_features: int) -> TilePlan:
    """The verified tile sizes for this shape at this thread count, measured on first use."""
    key = (out_features, in_features, torch.get_num_threads())
    plan = _plans.get(key)
    if plan is None:
        gen = torch.Generator().manual_seed(0)
        weight = pack_fp16(torch.randn(out_features, in_features, generator=gen))
        plan = _plans[key] = measure_tiles(lambda x: _gemm(x, weight), in_features, torch.float32, "cpu")
        if not plan.sizes:
            logger.info("fbgemm's fp16 GEMM keeps no tile size batch-invariant for %dx%d", *key[:2])
    return plan


def invariant_fp16_linear(x: torch.Tensor, weight: Fp16Weight) -> torch.Tensor:
    """``x [M, K] (fp32) @ weight.T`` in fp32, each row with the bits it would have alone."""
    plan = fp16_tile_plan(weight.out_features, weight.in_features)
    if not plan.sizes:
        raise RuntimeError(f"no batch-invariant fp16 tiling for {weight.out_features}x{weight.in_features}")
    return run_tiles(x.contiguous(), plan, lambda tile: _gemm(tile, weight))


def _gemm(x: torch.Tensor, weight: Fp16Weight) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(x, weight.packed)
