"""The half-precision CPU kernels (fbgemm's fp16 GEMM, oneDNN's bf16 GEMM, Cadence's bf16 dot GEMM): their values
against a float64 product with the rounded weight, every row's bits the same at any batch
size, and the planner refusing fp16 for weights it cannot hold."""

from __future__ import annotations

import logging
import platform
from pathlib import Path

import pytest
import torch

from cadence.engine.quantization.cpu_planner import plan_cpu_kernels
from cadence.engine.quantization.linear import Int8Linear
from cadence.kernels.batch_invariant.cpu_linear import cancellation_probe, measure_tiles
from cadence.kernels.cpu.half_linear import (
    BF16,
    BF16DOT,
    FP16,
    HalfFormat,
    available,
    invariant_half_linear,
    pack,
    tile_plan,
)
from cadence.kernels.formats.quant_formats import quantize_int8

X86 = platform.machine().lower() in ("x86_64", "amd64")


def test_x86_builds_have_fp16() -> None:
    assert available(FP16) or not X86


def test_bf16_is_offered_exactly_where_the_cpu_has_native_bf16() -> None:
    flags = Path("/proc/cpuinfo").read_text().split() if platform.system() == "Linux" else []
    native = "avx512_bf16" in flags or "amx_bf16" in flags
    assert available(BF16) == (native and torch.backends.mkldnn.is_available())


needs_fp16 = pytest.mark.skipif(not available(FP16), reason="this torch build has no fbgemm")
FORMATS = [
    pytest.param(FP16, marks=needs_fp16, id="fp16"),
    pytest.param(BF16, marks=pytest.mark.skipif(not available(BF16), reason="needs AVX512-BF16 or AMX"), id="bf16"),
    pytest.param(BF16DOT, marks=pytest.mark.skipif(not available(BF16DOT), reason="needs AVX512-BF16"), id="bf16dot"),
]


def rounded_product(fmt: HalfFormat, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the format computes, in float64: its rounding of the weight (and, for bf16, of
    the activations) before the product."""
    if fmt is FP16:
        return x.double() @ weight.half().double().t()
    return x.bfloat16().double() @ weight.bfloat16().double().t()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("n,k", [(64, 96), (200, 72), (49, 33)])
def test_values_are_the_rounded_weights_product(fmt: HalfFormat, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n)
    weight = torch.randn(n, k, generator=gen) / 5
    x = torch.randn(37, k, generator=gen)
    out = invariant_half_linear(x, pack(fmt, weight))
    reference = rounded_product(fmt, x, weight)
    assert out.dtype == torch.float32 and out.shape == (37, n)
    unrounded = x.double() @ weight.double().t()
    err = (out.double() - reference).abs()
    if fmt is FP16:
        # fp32 arithmetic: far nearer the rounded weight's product than the unrounded one's.
        assert err.max() < 1e-5 < (unrounded - reference).abs().max() / 10
    elif fmt is BF16DOT:
        # bf16 operands summed in fp32, the output not rounded again: within fp32's sum
        # error of the rounded operands' product, far nearer it than the unrounded one's.
        assert err.max() < 1e-5 < (unrounded - reference).abs().max() / 10
    else:
        # The output is rounded to bf16 (8 bits of mantissa), and is nearer the rounded
        # operands' product than the unrounded one's: the rounding is real.
        assert torch.equal(out, out.bfloat16().float())
        assert (err <= reference.abs() * 2**-8 + 1e-6).all()
        assert err.mean() < (out.double() - unrounded).abs().mean()


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_row_has_the_bits_it_has_alone(fmt: HalfFormat) -> None:
    gen = torch.Generator().manual_seed(0)
    weight = pack(fmt, torch.randn(160, 576, generator=gen) / 20)
    x = torch.randn(300, 576, generator=gen)
    assert tile_plan(fmt, 160, 576).sizes
    alone = torch.cat([invariant_half_linear(x[i : i + 1], weight) for i in range(x.shape[0])])
    for m in (2, 3, 7, 15, 16, 17, 32, 33, 64, 100, 129, 300):
        for start in (0, 5):
            rows = x[start : start + m]
            assert torch.equal(invariant_half_linear(rows, weight), alone[start : start + rows.shape[0]]), (m, start)


@needs_fp16
def test_the_planner_refuses_fp16_for_weights_beyond_its_range(caplog: pytest.LogCaptureFixture) -> None:
    weight = torch.randn(64, 96)
    weight[3, 5] = 1e5  # beyond fp16's 65504
    layer = Int8Linear(*quantize_int8(weight))
    with caplog.at_level(logging.INFO, logger="cadence.engine.quantization.cpu_planner"):
        plan_cpu_kernels([layer], torch.float32, "fp16")
    # auto's choice instead, without fp16
    assert layer.cpu_kernel == ("bf16dot" if available(BF16DOT) else "dense") and "fp16" not in layer.cpu_half
    assert "no fp16" in caplog.text and "fp16's range" in caplog.text
    x = torch.randn(4, 96)
    assert torch.isfinite(layer(x)).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_activations_are_not_offered_half_kernels(fmt: HalfFormat) -> None:
    """The half kernels take fp32 activations: a bf16 model runs auto's choice, its dense copy in bf16."""
    layer = Int8Linear(*quantize_int8(torch.randn(64, 96)))
    plan_cpu_kernels([layer], torch.bfloat16, fmt.name)
    assert layer.cpu_kernel == "dense" and layer.cpu_dense_dtype == torch.bfloat16 and not layer.cpu_half


def test_the_tile_check_sees_an_order_change_through_a_rounded_output() -> None:
    """A GEMM that sums K in two halves at one row and in one run otherwise, its output
    rounded to bf16: the cancellation probe separates the one-row size, as a real bf16
    GEMM's special one-row kernel must be."""
    weight, inputs = cancellation_probe(96, 1536, torch.bfloat16)

    def gemm(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            out = x[:, :768] @ weight[:, :768].t() + x[:, 768:] @ weight[:, 768:].t()
        else:
            out = x @ weight.t()
        return out.bfloat16().float()

    plan = measure_tiles(gemm, 1536, torch.float32, "cpu", inputs)
    assert plan.sizes and 1 not in plan.sizes


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_keep_their_bits_where_k_spans_several_blocks(fmt: HalfFormat) -> None:
    """SmolLM2's down projection's shape, on another probe than the tile check's own (bf16's
    GEMM sums K = 1536 in another order at one row on some CPUs, which random inputs
    rarely show)."""
    dense, x = cancellation_probe(576, 1536, fmt.weight_dtype, seed=11)
    weight = pack(fmt, dense)
    alone = torch.cat([invariant_half_linear(x[i : i + 1], weight) for i in range(x.shape[0])])
    for m in (2, 3, 16, 64, 100, 131):
        assert torch.equal(invariant_half_linear(x[:m], weight), alone[:m]), m


@pytest.mark.parametrize("fmt", FORMATS)
def test_no_rows_give_an_empty_product(fmt: HalfFormat) -> None:
    weight = pack(fmt, torch.randn(40, 64))
    out = invariant_half_linear(torch.empty(0, 64), weight)
    assert out.shape == (0, 40) and out.dtype == torch.float32
