"""CPU linears with half-precision weights kept prepacked, every row batch-invariant.

Three formats, each a GEMM that reads a weight packed once for it:

* ``fp16``: fbgemm's fp16 GEMM (``torch.ops.quantized.linear_dynamic_fp16``) converts the
  fp16 weight to fp32 in registers (F16C) and multiplies and sums in fp32, the scheme
  llama.cpp runs its f16 models with on x86. Half the bytes of fp32 to read at small
  batch; fp32 FMA speed at large batch.
* ``bf16``: oneDNN's bf16 GEMM on a weight reordered into its blocked layout
  (``torch.ops.mkldnn._linear_pointwise``, the call inductor's CPU backend makes):
  activations rounded to bf16, bf16 products summed in fp32 (AVX512-BF16 or AMX), the
  output rounded to bf16. Offered only where the CPU has bf16 instructions (AVX512-BF16
  or AMX); how it compares with the others there is the planner's to measure.
* ``bf16dot``: Cadence's own bf16 GEMM (``bf16_dot.py``), the same rounding of
  activations and weight and the same bf16 dot products, summed in one fixed order per
  row at any M, with an fp32 output. Offered on CPUs with AVX512-BF16.

The weight's values are rounded once (a quantized model's dequantized values, whose own
quantization error is far larger than this rounding). Like a BLAS GEMM, a kernel's sum
order may follow the number of rows, so calls run at tile sizes measured to give every
row the same bits (``batch_invariant/cpu_linear.measure_tiles``), per format, weight shape and
thread count (``bf16dot`` needs none). Where a format's GEMM is missing or no tile size
verifies, it is not offered.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cadence.kernels.batch_invariant.cpu_linear import (
    TILE_LADDER,
    TilePlan,
    cancellation_probe,
    measure_tiles,
    run_tiles,
)
from cadence.kernels.cpu import bf16_dot

logger = logging.getLogger(__name__)

FP16_MAX = 65504.0


@dataclass(frozen=True)
class HalfFormat:
    """How one half-precision format packs a ``[N, K]`` weight and multiplies by it."""

    name: str
    weight_dtype: torch.dtype  # what the weight is rounded to
    input_dtype: torch.dtype  # what the GEMM takes activations in
    pack: Callable[[torch.Tensor], object]  # an fp32 [N, K] weight -> the GEMM's packed weight
    # [M, K] activations in input_dtype x packed -> [M, N] in the format's output dtype
    gemm: Callable[[torch.Tensor, object], torch.Tensor]
    packed_bytes: Callable[[int, int], int]  # an upper bound on a packed [N, K] weight's bytes
    hardware_ready: Callable[[], bool]  # whether the CPU runs this format natively
    # Whether the GEMM sums every row in one fixed order at any M by construction, so it
    # runs whole batches without tiles.
    row_independent: bool = False


@dataclass(frozen=True)
class HalfWeight:
    """A ``[N, K]`` weight prepacked for one format's GEMM."""

    fmt: HalfFormat
    packed: object  # the format's packed weight (an opaque object)
    out_features: int
    in_features: int


def _pack_fp16(weight: torch.Tensor) -> object:
    if weight.numel() and not bool(weight.abs().max() <= FP16_MAX):
        raise ValueError("the weight holds values beyond fp16's range")
    return torch.ops.quantized.linear_prepack_fp16(weight, None)


def _fp16_gemm(x: torch.Tensor, packed: object) -> torch.Tensor:
    return torch.ops.quantized.linear_dynamic_fp16(x, packed)


def _fp16_bytes(out_features: int, in_features: int) -> int:
    # fbgemm packs K in blocks of 512 and N in column blocks of at most 32.
    return -(-out_features // 32) * 32 * (-(-in_features // 512) * 512) * 2


# The batch-size hint oneDNN's weight reorder takes; the blocked layout serves every M.
_BF16_REORDER_HINT = 64


def _pack_bf16(weight: torch.Tensor) -> object:
    return torch.ops.mkldnn._reorder_linear_weight(weight.to(torch.bfloat16), _BF16_REORDER_HINT)


def _bf16_gemm(x: torch.Tensor, packed: object) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def _bf16_bytes(out_features: int, in_features: int) -> int:
    # oneDNN's blocked layouts pad N and K to whole blocks (at most 64 wide).
    return -(-out_features // 64) * 64 * (-(-in_features // 64) * 64) * 2


def native_bf16() -> bool:
    """Whether the CPU has bf16 dot products (AVX512-BF16) or AMX tiles, the instructions
    oneDNN's bf16 kernels compute with; without them it converts to fp32 and back."""
    # Private helpers, but the same ones torch's own CPU dispatch consults; a torch
    # without them is treated as "no native bf16", the conservative answer.
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and bool(fn()):
            return True
    return False


def _bf16_native() -> bool:
    return bool(torch.backends.mkldnn.is_available() and native_bf16())


FP16 = HalfFormat("fp16", torch.float16, torch.float32, _pack_fp16, _fp16_gemm, _fp16_bytes, lambda: True)
BF16 = HalfFormat("bf16", torch.bfloat16, torch.bfloat16, _pack_bf16, _bf16_gemm, _bf16_bytes, _bf16_native)
# Cadence's own bf16 GEMM (``bf16_dot.py``): oneDNN's arithmetic in a fixed order per row.
BF16DOT = HalfFormat(
    "bf16dot",
    torch.bfloat16,
    torch.bfloat16,
    bf16_dot.pack,
    bf16_dot.gemm,  # type: ignore[arg-type]
    bf16_dot.packed_bytes,
    bf16_dot.hardware_ready,
    row_independent=True,
)
FORMATS = {fmt.name: fmt for fmt in (FP16, BF16, BF16DOT)}

_plans: dict[tuple[str, int, int, int], TilePlan] = {}
_available: dict[str, bool] = {}


def available(fmt: HalfFormat) -> bool:
    """Whether this torch build and CPU run ``fmt``'s GEMM natively, with the right values."""
    if fmt.name not in _available:
        try:
            # The hardware first: a GEMM whose instructions the CPU lacks must not even compile.
            if not fmt.hardware_ready():
                _available[fmt.name] = False
                return False
            ones = pack(fmt, torch.ones(16, 16))
            x = torch.ones(1, 16, dtype=fmt.input_dtype)
            _available[fmt.name] = torch.equal(fmt.gemm(x, ones.packed).float(), torch.full((1, 16), 16.0))
        except (RuntimeError, AttributeError, NotImplementedError):
            _available[fmt.name] = False
    return _available[fmt.name]


def pack(fmt: HalfFormat, weight: torch.Tensor) -> HalfWeight:
    """``weight`` (``[N, K]``, any float dtype) rounded to ``fmt`` and packed. ValueError
    where a value does not fit the format."""
    dense = weight.detach().float().contiguous()
    return HalfWeight(fmt, fmt.pack(dense), dense.shape[0], dense.shape[1])


def tile_plan(fmt: HalfFormat, out_features: int, in_features: int) -> TilePlan:
    """The verified tile sizes for this format and shape at this thread count, measured on
    first use; every size of the ladder for a row-independent format."""
    if fmt.row_independent:
        return TilePlan(TILE_LADDER)
    key = (fmt.name, out_features, in_features, torch.get_num_threads())
    plan = _plans.get(key)
    if plan is None:
        dense, inputs = cancellation_probe(out_features, in_features, fmt.weight_dtype)
        weight = pack(fmt, dense)

        def gemm(x: torch.Tensor) -> torch.Tensor:
            return fmt.gemm(x, weight.packed)

        # In the GEMM's own input dtype, so the check's shifted and copied views are what
        # serving passes (views into one cast batch), not fresh casts of each.
        plan = _plans[key] = measure_tiles(gemm, in_features, fmt.input_dtype, "cpu", inputs)
        if not plan.sizes:
            logger.info("the %s GEMM keeps no tile size batch-invariant for %dx%d", fmt.name, *key[1:3])
    return plan


def invariant_half_linear(x: torch.Tensor, weight: HalfWeight) -> torch.Tensor:
    """``x [M, K] @ weight.T`` as fp32 (for bf16, bf16-rounded values widened), each row
    with the bits it would have alone; ``x`` is cast to the format's input dtype."""
    if weight.fmt.row_independent:
        return weight.fmt.gemm(x.to(weight.fmt.input_dtype).contiguous(), weight.packed)
    plan = tile_plan(weight.fmt, weight.out_features, weight.in_features)
    if not plan.sizes:
        raise RuntimeError(
            f"no batch-invariant {weight.fmt.name} tiling for {weight.out_features}x{weight.in_features}"
        )
    rows = x.to(weight.fmt.input_dtype).contiguous()
    return run_tiles(rows, plan, lambda tile: weight.fmt.gemm(tile, weight.packed), torch.float32)
