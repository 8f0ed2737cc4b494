"""The whole-weight dequantize kernels and the large-M path of W8A16 / W4A16 that uses them.

Under TRITON_INTERPRET=1 on CPU tensors, tiny ragged shapes (N not a multiple of the
block, K words not a multiple of the block). The dense weights must equal the torch
definitions bit for bit: both form the value exactly in fp32 and round once. The
matmuls then compare with the kernels' references at the quant tests' tolerances.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from cadence.kernels.formats.quant_formats import Int4Weight, dequantize_int8, quantize_int4, quantize_int8
from cadence.kernels.triton import dequant, w4a16, w8a16
from tests.support.helpers import DEVICE, KERNEL_TOL, gen, poisoned, rel_err


def int4_weights(k: int, n: int, group: int) -> dict[str, Int4Weight]:
    w = torch.randn(n, k, generator=gen(k + n + group)).to(DEVICE)
    asym = quantize_int4(w, group, symmetric=False)
    assert asym.zeros is not None
    return {
        "sym": quantize_int4(w, group, symmetric=True),
        "zeros": asym,
        "float zeros": Int4Weight(asym.qweight, asym.scales.half(), asym.zeros.float() + 0.25, group),
    }


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("k", "n", "group"), [(96, 48, 32), (256, 136, 128), (64, 130, 64)])
def test_int4_to_dense_equals_the_torch_definition(dtype: torch.dtype, k: int, n: int, group: int) -> None:
    for name, weight in int4_weights(k, n, group).items():
        got = dequant.int4_to_dense(weight, dtype)
        assert got.shape == (k, n) and got.dtype == dtype
        assert torch.equal(got, dequant.reference_int4(weight, dtype)), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("n", "k"), [(48, 96), (130, 200)])
def test_int8_to_dense_equals_the_torch_definition(dtype: torch.dtype, n: int, k: int) -> None:
    qweight, scale = quantize_int8(torch.randn(n, k, generator=gen(n + k)).to(DEVICE))
    got = dequant.int8_to_dense(qweight, scale, dtype)
    assert got.shape == (n, k) and torch.equal(got, dequantize_int8(qweight, scale, dtype))
    # A column slice (row stride != K) reads through its strides.
    view = qweight[:, 8:]
    assert torch.equal(dequant.int8_to_dense(view, scale, dtype), dequantize_int8(view, scale, dtype))


class CallCounter:
    """Wraps a function and counts its calls (which path a wrapper took)."""

    def __init__(self, fn: Callable[..., torch.Tensor]) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_w4a16_takes_the_dense_path_from_the_threshold(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    spy = CallCounter(dequant.int4_to_dense)
    monkeypatch.setattr(w4a16, "int4_to_dense", spy)
    k, n = 128, 40
    for name, weight in int4_weights(k, n, 32).items():
        for m, dense_path in ((7, False), (8, True), (19, True)):
            before = spy.calls
            x = torch.randn(m, k, generator=gen(m)).to(DEVICE, dtype)
            out = w4a16.w4a16_matmul(x, weight, out=poisoned(m, n, dtype, DEVICE), dequant_min_m=8)
            assert (spy.calls > before) == dense_path, (name, m)
            assert rel_err(out, w4a16.reference(x, weight)) < KERNEL_TOL[dtype], (name, m)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_w8a16_takes_the_dense_path_from_the_threshold(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    spy = CallCounter(dequant.int8_to_dense)
    monkeypatch.setattr(w8a16, "int8_to_dense", spy)
    k, n = 96, 72
    qweight, scale = quantize_int8(torch.randn(n, k, generator=gen(5)).to(DEVICE))
    scale = scale.to(dtype)
    for m, dense_path in ((7, False), (8, True), (19, True)):
        before = spy.calls
        x = torch.randn(m, k, generator=gen(m)).to(DEVICE, dtype)
        out = w8a16.w8a16_matmul(x, qweight, scale, out=poisoned(m, n, dtype, DEVICE), dequant_min_m=8)
        assert (spy.calls > before) == dense_path, m
        assert rel_err(out, w8a16.reference(x, qweight, scale)) < KERNEL_TOL[dtype], m


def test_w8a16_dense_path_takes_a_float32_scale_with_half_activations() -> None:
    # The int8 LM head's case during prefill with prompt logprobs: fp32 scales, fp16 rows.
    qweight, scale = quantize_int8(torch.randn(72, 96, generator=gen(6)).to(DEVICE), torch.float32)
    x = torch.randn(2, 5, 96, generator=gen(7)).to(DEVICE, torch.float16)  # leading dims flatten to rows
    out = w8a16.w8a16_matmul(x, qweight, scale, dequant_min_m=8)
    assert out.shape == (2, 5, 72) and out.dtype == torch.float16
    assert rel_err(out, w8a16.reference(x, qweight, scale)) < KERNEL_TOL[torch.float16]


def test_decode_batches_stay_below_the_threshold() -> None:
    # CUDA graphs capture decode steps of up to 256 rows; a transient dense weight inside a
    # graph would pin its memory in the graph's pool.
    from cadence.engine.cuda_graphs import CAPTURE_BATCH_SIZES

    assert dequant.DEQUANT_MIN_M > max(CAPTURE_BATCH_SIZES)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_dense_path_matches_reference(dtype: torch.dtype) -> None:
    k, n, m = 4096, 1000, dequant.DEQUANT_MIN_M
    w = torch.randn(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda").to(dtype)
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    q, s = quantize_int8(w.to(dtype))
    assert rel_err(w8a16.w8a16_matmul(x, q, s, out=poisoned(m, n, dtype, "cuda")), w8a16.reference(x, q, s)) < tol
    for symmetric in (True, False):
        weight = quantize_int4(w.to(dtype), 128, symmetric)
        assert torch.equal(dequant.int4_to_dense(weight, dtype), dequant.reference_int4(weight, dtype))
        out = w4a16.w4a16_matmul(x, weight, out=poisoned(m, n, dtype, "cuda"))
        assert rel_err(out, w4a16.reference(x, weight)) < tol
