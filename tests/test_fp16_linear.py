"""fbgemm's fp16-weight GEMM as a CPU kernel: its values against a float64 product with the
fp16-rounded weight, every row's bits the same at any batch size, and the planner refusing
it for weights fp16 cannot hold."""

from __future__ import annotations

import logging
import platform

import pytest
import torch

from cadence.engine.quantization.cpu_kernels import KernelPlan
from cadence.engine.quantization.cpu_planner import plan_cpu_kernels
from cadence.engine.quantization.linear import Int8Linear
from cadence.kernels.fp16_linear import fp16_gemm_available, fp16_tile_plan, invariant_fp16_linear, pack_fp16
from cadence.kernels.quant_formats import quantize_int8

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_x86_builds_have_the_kernel() -> None:
    assert fp16_gemm_available() or not X86


needs_fp16 = pytest.mark.skipif(not fp16_gemm_available(), reason="this torch build has no fbgemm")


@needs_fp16
@pytest.mark.parametrize("n,k", [(64, 96), (200, 72), (49, 33)])
def test_values_are_the_fp16_rounded_weight_in_fp32(n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=gen) / 5
    x = torch.randn(37, k, generator=gen)
    out = invariant_fp16_linear(x, pack_fp16(weight))
    reference = x.double() @ weight.half().double().t()
    assert out.dtype == torch.float32 and out.shape == (37, n)
    # Far nearer the rounded weight's product than the unrounded one's: the rounding is real.
    err = (out.double() - reference).abs().max()
    unrounded = x.double() @ weight.double().t()
    assert err < 1e-5 < (unrounded - reference).abs().max() / 10


@needs_fp16
def test_every_row_has_the_bits_it_has_alone() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = pack_fp16(torch.randn(160, 576, generator=gen) / 20)
    x = torch.randn(300, 576, generator=gen)
    assert fp16_tile_plan(160, 576).sizes
    alone = torch.cat([invariant_fp16_linear(x[i : i + 1], weight) for i in range(x.shape[0])])
    for m in (2, 3, 7, 15, 16, 17, 32, 33, 64, 100, 129, 300):
        for start in (0, 5):
            rows = x[start : start + m]
            assert torch.equal(invariant_fp16_linear(rows, weight), alone[start : start + rows.shape[0]]), (m, start)


@needs_fp16
def test_the_planner_refuses_fp16_for_weights_beyond_its_range(caplog) -> None:
    weight = torch.randn(64, 96)
    weight[3, 5] = 1e5  # beyond fp16's 65504
    layer = Int8Linear(*quantize_int8(weight))
    with caplog.at_level(logging.INFO, logger="cadence.engine.quantization.cpu_planner"):
        plan_cpu_kernels([layer], torch.float32, "fp16")
    assert layer.cpu_plan == KernelPlan.fixed("packed") and layer.cpu_fp16 is None
    assert "no fp16" in caplog.text and "fp16's range" in caplog.text
    x = torch.randn(4, 96)
    assert torch.isfinite(layer(x)).all()


@needs_fp16
def test_bf16_activations_are_not_offered_fp16() -> None:
    layer = Int8Linear(*quantize_int8(torch.randn(64, 96)))
    plan_cpu_kernels([layer], torch.bfloat16, "fp16")
    assert layer.cpu_plan == KernelPlan.fixed("packed") and layer.cpu_fp16 is None
