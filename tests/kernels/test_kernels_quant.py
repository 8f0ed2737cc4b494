"""Weight-only quantized GEMMs (W8A16, W4A16) and the int4 checkpoint converters.

On a machine without CUDA the Triton kernels run under TRITON_INTERPRET=1 on CPU
tensors; conftest.py sets it before anything imports triton. Shapes are tiny and ragged
(N not a multiple of the block) and outputs are pre-filled with NaN, so an element a
kernel forgets to write fails the comparison.

Tolerances (relative Frobenius error ||out - ref|| / ||ref||):
* kernel vs its torch reference: fp32 1e-5, fp16 2e-3 (same dequantized weights, only
  the accumulation order and the final fp16 rounding differ);
* quantized vs dense matmul: int8 < 2e-2 on outputs (< 1e-2 on the weight itself),
  int4 weight error < 0.12 at group 32 and < 0.16 at group 128, outputs < 0.2.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton

from cadence.kernels.formats.quant_formats import (
    Int4Weight,
    dequantize_int4,
    dequantize_int8,
    from_awq,
    from_gptq,
    quantize_int4,
    quantize_int8,
    to_awq,
    to_gptq,
    unpack_int4,
)
from cadence.kernels.triton import launch, split_k, tile_configs, w4a16, w4a16_gemv, w8a16
from cadence.kernels.triton.launch import TILED_PROGRAMS_PER_SM, split_k_to_fill
from tests.support.helpers import DEVICE, KERNEL_TOL, gen, poisoned, rel_err

# bf16: the reference rounds each dequantized weight to bf16, the GEMV keeps it in fp32.
# (K, group) pairs the shapes allow.
K_GROUPS = [(64, 32), (64, 64), (128, 32), (128, 128)]


# ---------------------------------------------------------------- quantizers


def test_int8_quantization_error_is_small() -> None:
    w = torch.randn(40, 128, generator=gen(1))
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and q.shape == (40, 128) and scale.shape == (40,)
    assert rel_err(dequantize_int8(q, scale, torch.float32), w) < 1e-2
    zero_row = torch.zeros(2, 64)
    q0, s0 = quantize_int8(zero_row)
    assert torch.isfinite(dequantize_int8(q0, s0)).all() and not q0.any()


@pytest.mark.parametrize("symmetric", [True, False])
def test_int4_quantization_error_bounded(symmetric: bool) -> None:
    w = torch.randn(40, 128, generator=gen(2))
    errs = {}
    for group in (32, 64, 128):
        qw = quantize_int4(w, group, symmetric)
        assert qw.qweight.dtype == torch.int32 and qw.qweight.shape == (16, 40)
        assert qw.scales.shape == (128 // group, 40)
        assert (qw.zeros is None) == symmetric
        errs[group] = rel_err(dequantize_int4(qw, torch.float32), w)
    assert errs[32] < 0.12 and errs[128] < 0.16, errs
    assert errs[32] < errs[128], errs  # smaller groups track the weights more closely


def test_int4_rejects_bad_group() -> None:
    with pytest.raises(ValueError):
        quantize_int4(torch.randn(8, 96), group_size=64)


# ---------------------------------------------------------------- W8A16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k,n", [(64, 24), (128, 40)])
def test_w8a16_matches_reference(dtype: torch.dtype, m: int, k: int, n: int) -> None:
    g = gen(100 + m + k + n)
    w = torch.randn(n, k, generator=g).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    q, scale = quantize_int8(w.to(dtype))
    out = w8a16.w8a16_matmul(x, q, scale, out=poisoned(m, n, dtype, DEVICE))
    ref = w8a16.reference(x, q, scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < KERNEL_TOL[dtype]
    assert rel_err(out, x.float() @ w.t()) < 2e-2  # int8 costs little accuracy


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 2])
@pytest.mark.parametrize("k", [1000, 512])
def test_w8a16_decode_rows_split_ragged_k(dtype: torch.dtype, m: int, k: int) -> None:
    """Decode rows: K in whole tiles split across programs, the last tile partial."""
    g = gen(300 + m + k)
    n = 40
    w, x = torch.randn(n, k, generator=g).to(DEVICE), torch.randn(m, k, generator=g).to(DEVICE, dtype)
    q, scale = quantize_int8(w.to(dtype))
    first = w8a16.w8a16_matmul(x, q, scale, out=poisoned(m, n, dtype, DEVICE), k_splits=4)
    assert rel_err(first, w8a16.reference(x, q, scale)) < KERNEL_TOL[dtype]
    # The split slices are summed in a fixed order, and the tickets re-arm for the next call.
    assert not split_k.counters(x.device).any()
    again = w8a16.w8a16_matmul(x, q, scale, out=poisoned(m, n, dtype, DEVICE), k_splits=4)
    assert torch.equal(again, first)


# ---------------------------------------------------------------- W4A16


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("k,group", K_GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_matches_reference(dtype: torch.dtype, m: int, k: int, group: int, symmetric: bool) -> None:
    n = 40 if k == 128 else 24
    g = gen(1000 + m * 7 + k + group + int(symmetric))
    w = torch.randn(n, k, generator=g).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    qw = quantize_int4(w.to(dtype), group, symmetric)
    out = w4a16.w4a16_matmul(x, qw, out=poisoned(m, n, dtype, DEVICE))
    ref = w4a16.reference(x, qw)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < KERNEL_TOL[dtype]
    assert rel_err(out, x.float() @ w.t()) < 0.2  # int4 is lossy, but bounded


@pytest.mark.parametrize("threshold,m", [(0, 3), (4, 4)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_w4a16_threshold_picks_either_kernel(threshold: int, m: int, symmetric: bool) -> None:
    """Force the GEMM at small M, and the GEMV at its largest M: both must be right."""
    g = gen(7 + m)
    w = torch.randn(24, 128, generator=g).to(DEVICE)
    x = torch.randn(m, 128, generator=g).to(DEVICE, torch.float16)
    qw = quantize_int4(w.half(), 32, symmetric)
    out = w4a16.w4a16_matmul(x, qw, out=poisoned(m, 24, torch.float16, DEVICE), small_m_threshold=threshold)
    assert rel_err(out, w4a16.reference(x, qw)) < KERNEL_TOL[torch.float16]


# fp16 pairs, bf16 pairs (bit operations and fp32 math only: valid in the interpreter), fp32.
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("n", [24, 300])  # one ragged column block; three, the last ragged
@pytest.mark.parametrize("zeros", ["symmetric", "uint8", "float"])
def test_w4a16_gemv_split_k_matches_reference(dtype: torch.dtype, m: int, n: int, zeros: str) -> None:
    """A long K: the GEMV splits it, and the last slice of each column block sums the partials."""
    k, group = 512, 32
    assert w4a16_gemv.choose_splits(-(-n // w4a16_gemv.BLOCK_N), k // w4a16_gemv.BLOCK_K, 8) > 1
    g = gen(30 + m + n + len(zeros))
    w = torch.randn(n, k, generator=g).to(DEVICE)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    qw = quantize_int4(w.to(dtype), group, zeros == "symmetric")
    if zeros == "float":  # GGUF Q4_1's real-valued zero points
        assert qw.zeros is not None
        qw = Int4Weight(qw.qweight, qw.scales, qw.zeros.float() + 0.25, group)
    for _ in range(2):  # the second call finds the split counters re-armed
        out = w4a16.w4a16_matmul(x, qw, out=poisoned(m, n, dtype, DEVICE), small_m_threshold=w4a16_gemv.GEMV_MAX_M)
        assert rel_err(out, w4a16.reference(x, qw)) < KERNEL_TOL[dtype]
        assert not split_k.counters(x.device).any()


def test_w4a16_gemv_splits_toward_three_programs_per_sm() -> None:
    """Llama-8B's projections on 132 SMs: the split counts the H100 sweep found best."""
    assert w4a16_gemv.choose_splits(n_blocks=48, k_tiles=32, num_sms=132) == 8  # qkv
    assert w4a16_gemv.choose_splits(n_blocks=32, k_tiles=32, num_sms=132) == 8  # o
    assert w4a16_gemv.choose_splits(n_blocks=224, k_tiles=32, num_sms=132) == 1  # gate_up
    assert w4a16_gemv.choose_splits(n_blocks=32, k_tiles=112, num_sms=132) == 8  # down
    assert w4a16_gemv.choose_splits(n_blocks=1, k_tiles=3, num_sms=132) == 1  # K tiles must divide


def test_split_k_fills_the_gpu_with_whole_tiles() -> None:
    def fill(n_blocks: int, k_tiles: int) -> int:
        return split_k_to_fill(n_blocks, k_tiles, num_sms=132, programs_per_sm=8)

    assert fill(n_blocks=448, k_tiles=64) == 4  # 1792 programs >= 8 per SM
    assert fill(n_blocks=64, k_tiles=32) == 16  # capped: two tiles per slice
    assert fill(n_blocks=64, k_tiles=6) == 2  # 6 tiles halve once, into 3-tile slices
    assert fill(n_blocks=1100, k_tiles=64) == 1


def test_tiled_split_k_fills_one_wave_within_a_traffic_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama-8B on 132 SMs, BLOCK_N = BLOCK_K = 64: o_proj and down_proj are 64 column
    blocks. The partials' traffic (8 bytes per output per split) stays within a quarter
    of the weight bytes, so the split shrinks as M grows, faster for int4."""
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    assert split_k_to_fill(n_blocks=64, k_tiles=64, num_sms=132, programs_per_sm=TILED_PROGRAMS_PER_SM) == 8

    def split(m: int, n_blocks: int, k: int, weight_bytes: int, out: torch.Tensor | None = None) -> int:
        out = torch.empty(m, 64) if out is None else out
        return launch.tiled_split_k(m, 1, n_blocks, k // 64, weight_bytes, out, None)

    assert split(16, 64, 4096, 4096) == 8  # o_proj int8: 8 x 16 x 8 B = 1 KiB, a quarter of 4 KiB
    assert split(16, 64, 4096, 2048) == 4  # int4 has half the bytes
    assert split(64, 64, 4096, 4096) == 2
    assert split(64, 64, 4096, 2048) == 1
    assert split(4, 448, 4096, 2048) == 1  # gate_up_proj: 448 programs already fill a wave
    assert split(4, 64, 4096, 4096, out=torch.empty(64, 4).t()) == 1  # store_tile writes unit stride
    assert launch.tiled_split_k(100, 2, 1, 8, 4096, torch.empty(100, 64), None) == 1  # two M blocks
    assert launch.tiled_split_k(100, 2, 1, 8, 4096, torch.empty(100, 64), 1) == 1
    with pytest.raises(ValueError, match="one M block"):
        launch.tiled_split_k(100, 2, 1, 8, 4096, torch.empty(100, 64), 2)


@pytest.fixture
def launched_splits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The split count of every W8A16/W4A16 launch that asks split_k for a workspace."""
    seen: list[int] = []
    workspace = split_k.workspace

    def recording(num_splits: int, m: int, n: int, n_blocks: int, out: torch.Tensor) -> torch.Tensor:
        seen.append(num_splits)
        return workspace(num_splits, m, n, n_blocks, out)

    monkeypatch.setattr(split_k, "workspace", recording)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [3, 17, 40])  # BLOCK_M 16, 32, 64: one M block each
def test_w8a16_tiled_split_k_matches_reference(dtype: torch.dtype, m: int, launched_splits: list[int]) -> None:
    """The tiled kernel splits a long, ragged K; the partials meet in order. Counts that
    do not divide the K tiles leave the last slices short or empty (8 tiles of 128 in 5
    slices: 4 x 2 tiles + 0)."""
    n, k = 72, 1000  # two column blocks, the last ragged; K tiles whose last is partial
    g = gen(400 + m)
    w, x = torch.randn(n, k, generator=g).to(DEVICE), torch.randn(m, k, generator=g).to(DEVICE, dtype)
    q, scale = quantize_int8(w.to(dtype))
    ref = w8a16.reference(x, q, scale)
    default = w8a16.w8a16_matmul(x, q, scale, out=poisoned(m, n, dtype, DEVICE))
    k_tiles = triton.cdiv(k, tile_configs.w8a16_tile(m).block_k)
    assert launched_splits == [launch.tiled_split_k(m, 1, 2, k_tiles, k, default, None)]
    assert launched_splits[0] > 1 or m > 3  # M = 3 splits by default; more rows cost more traffic
    results = [default]
    for k_splits in (4, 5, 1):
        launched_splits.clear()
        results.append(w8a16.w8a16_matmul(x, q, scale, out=poisoned(m, n, dtype, DEVICE), k_splits=k_splits))
        assert launched_splits == [k_splits]
    for out in results:
        assert rel_err(out, ref) < KERNEL_TOL[dtype]
    assert not split_k.counters(x.device).any()  # the tickets re-arm for the next call
    assert torch.equal(
        w8a16.w8a16_matmul(x, q, scale, out=poisoned(m, n, dtype, DEVICE), k_splits=4), results[1]
    )  # the sum's order is fixed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m", [5, 33])
@pytest.mark.parametrize("group,symmetric", [(32, False), (128, True)])
def test_w4a16_tiled_split_k_matches_reference(
    dtype: torch.dtype, m: int, group: int, symmetric: bool, launched_splits: list[int]
) -> None:
    """Above the GEMV's rows the tiled GEMM splits K in whole tiles, groups intact; 5
    slices of 16, 32 or 64 tiles leave the last one short or empty."""
    n, k = 72, 2048
    g = gen(500 + m + group)
    w, x = torch.randn(n, k, generator=g).to(DEVICE), torch.randn(m, k, generator=g).to(DEVICE, dtype)
    qw = quantize_int4(w.to(dtype), group, symmetric)
    ref = w4a16.reference(x, qw)
    for k_splits in (None, 1, 5):
        launched_splits.clear()
        out = w4a16.w4a16_matmul(x, qw, out=poisoned(m, n, dtype, DEVICE), k_splits=k_splits)
        assert rel_err(out, ref) < KERNEL_TOL[dtype]
        assert not split_k.counters(x.device).any()
        if k_splits is None:
            tile = tile_configs.w4a16_tile(m)
            n_blocks, k_tiles = triton.cdiv(n, tile.block_n), k // min(group, tile.block_k)
            assert launched_splits == [launch.tiled_split_k(m, 1, n_blocks, k_tiles, k // 2, out, None)]
            assert launched_splits[0] > 1 or m > 5  # 5 rows split by default; more cost more traffic
        else:
            assert launched_splits == [k_splits]


@pytest.mark.parametrize("kernel", ["w8a16", "w4a16"])
def test_tiled_kernels_write_an_output_with_any_column_stride(kernel: str) -> None:
    """A caller's transposed ``out``: the split's finish writes unit stride only, so
    the launch does not split, and asking for a split is an error."""
    m, n, k = 17, 72, 1024
    g = gen(600)
    w, x = torch.randn(n, k, generator=g).to(DEVICE), torch.randn(m, k, generator=g).to(DEVICE, torch.float16)
    q8, s8 = quantize_int8(w.half())
    qw = quantize_int4(w.half(), 64, False)

    def run(out: torch.Tensor, k_splits: int | None = None) -> torch.Tensor:
        if kernel == "w8a16":
            return w8a16.w8a16_matmul(x, q8, s8, out=out, k_splits=k_splits)
        return w4a16.w4a16_matmul(x, qw, out=out, k_splits=k_splits)

    ref = w8a16.reference(x, q8, s8) if kernel == "w8a16" else w4a16.reference(x, qw)
    out = torch.full((n, m), float("nan"), dtype=torch.float16, device=DEVICE).t()
    assert rel_err(run(out), ref) < KERNEL_TOL[torch.float16]
    with pytest.raises(ValueError, match="unit column stride"):
        run(out, k_splits=2)


@pytest.mark.parametrize("m", [1, 17])  # the GEMV and the tiled kernel
def test_w4a16_real_valued_zero_points(m: int) -> None:
    """GGUF Q4_1 blocks carry a float zero point (-min / d): both kernels must use it as is."""
    g = gen(20 + m)
    n, k = 40, 64
    base = quantize_int4(torch.randn(n, k, generator=g).to(DEVICE), 32, symmetric=True)
    zeros = torch.rand(k // 32, n, generator=g).to(DEVICE) * 15  # fractional, anywhere in the code range
    qw = Int4Weight(base.qweight, base.scales.half(), zeros, 32)
    x = torch.randn(m, k, generator=g).to(DEVICE, torch.float16)
    out = w4a16.w4a16_matmul(x, qw, out=poisoned(m, n, torch.float16, DEVICE))
    ref = w4a16.reference(x, qw)
    assert rel_err(out, ref) < KERNEL_TOL[torch.float16]
    # The zero point is used unrounded: rounding it would move every weight in a group.
    rounded = Int4Weight(qw.qweight, qw.scales, zeros.round().to(torch.uint8), 32)
    assert rel_err(ref, w4a16.reference(x, rounded)) > 10 * KERNEL_TOL[torch.float16]


def test_w4a16_batched_input_and_fp32_scales_with_fp16_x() -> None:
    g = gen(11)
    w = torch.randn(40, 128, generator=g).to(DEVICE)
    x = torch.randn(2, 3, 128, generator=g).to(DEVICE, torch.float16)
    qw = quantize_int4(w, 64, symmetric=False)  # fp32 scales, fp16 activations
    out = w4a16.w4a16_matmul(x, qw)
    assert out.shape == (2, 3, 40) and out.dtype == torch.float16
    assert rel_err(out, w4a16.reference(x, qw)) < KERNEL_TOL[torch.float16]


def test_cpu_without_interpreter_falls_back_to_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x = torch.randn(3, 64, generator=gen(12))
    qw = quantize_int4(torch.randn(24, 64, generator=gen(13)), 32)
    assert torch.equal(w4a16.w4a16_matmul(x, qw), w4a16.reference(x, qw))
    q, s = quantize_int8(torch.randn(24, 64, generator=gen(14)))
    assert torch.equal(w8a16.w8a16_matmul(x, q, s), w8a16.reference(x, q, s))


# ---------------------------------------------------------------- GPTQ / AWQ


def _words(arr: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(arr.astype(np.uint32).view(np.int32).copy())


def literal_gptq(codes: np.ndarray, zeros: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ v1 written out from its description: qweight packs K, qzeros packs N and stores z-1."""
    k, n = codes.shape
    qweight = np.zeros((k // 8, n), dtype=np.uint64)
    for r in range(k):
        qweight[r // 8] |= codes[r].astype(np.uint64) << np.uint64(4 * (r % 8))
    qzeros = np.zeros((zeros.shape[0], n // 8), dtype=np.uint64)
    for c in range(n):
        qzeros[:, c // 8] |= ((zeros[:, c].astype(np.int64) - 1) & 0xF).astype(np.uint64) << np.uint64(4 * (c % 8))
    return _words(qweight), _words(qzeros)


def literal_awq(codes: np.ndarray, zeros: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """AWQ GEMM packing: columns 8c + order[i] go to nibble i of word c."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]

    def pack(a: np.ndarray) -> torch.Tensor:
        words = np.zeros((a.shape[0], a.shape[1] // 8), dtype=np.uint64)
        for c in range(a.shape[1] // 8):
            for i in range(8):
                words[:, c] |= a[:, 8 * c + order[i]].astype(np.uint64) << np.uint64(4 * i)
        return _words(words)

    return pack(codes), pack(zeros)


def _dense_zeros(qw: Int4Weight) -> np.ndarray:
    return np.full(tuple(qw.scales.shape), 8) if qw.zeros is None else qw.zeros.numpy()


@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("symmetric", [True, False])
def test_gptq_round_trip(group: int, symmetric: bool) -> None:
    w = torch.randn(40, 128, generator=gen(20 + group))
    ours = quantize_int4(w.half(), group, symmetric)
    qweight, qzeros = literal_gptq(unpack_int4(ours).numpy(), _dense_zeros(ours))
    packed = to_gptq(ours)
    assert torch.equal(packed["qweight"], qweight) and torch.equal(packed["qzeros"], qzeros)
    back = from_gptq(qweight, qzeros, ours.scales, packed["g_idx"], group_size=group)
    assert torch.equal(back.qweight, ours.qweight)
    assert (back.zeros is None) == symmetric  # symmetric GPTQ (all zeros 8) needs no zero load
    assert torch.equal(dequantize_int4(back), dequantize_int4(ours))
    x = torch.randn(3, 128, generator=gen(21)).half()
    assert rel_err(w4a16.w4a16_matmul(x, back), w4a16.reference(x, ours)) < KERNEL_TOL[torch.float16]


def test_gptq_rejects_act_order() -> None:
    ours = quantize_int4(torch.randn(24, 64, generator=gen(22)), 32)
    packed = to_gptq(ours)
    g_idx = packed["g_idx"][torch.randperm(64, generator=gen(23))]
    with pytest.raises(ValueError, match="act-order"):
        from_gptq(packed["qweight"], packed["qzeros"], packed["scales"], g_idx, group_size=32)


@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("symmetric", [True, False])
def test_awq_round_trip(group: int, symmetric: bool) -> None:
    w = torch.randn(24, 64, generator=gen(30 + group))
    ours = quantize_int4(w.half(), group, symmetric)
    qweight, qzeros = literal_awq(unpack_int4(ours).numpy(), _dense_zeros(ours))
    packed = to_awq(ours)
    assert torch.equal(packed["qweight"], qweight) and torch.equal(packed["qzeros"], qzeros)
    back = from_awq(qweight, qzeros, ours.scales, group_size=group)
    assert torch.equal(back.qweight, ours.qweight)
    assert torch.equal(dequantize_int4(back), dequantize_int4(ours))
    x = torch.randn(17, 64, generator=gen(31)).half()
    assert rel_err(w4a16.w4a16_matmul(x, back), w4a16.reference(x, ours)) < KERNEL_TOL[torch.float16]


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 8, 33, 300])
def test_gpu_kernels_match_reference(dtype: torch.dtype, m: int) -> None:
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    k, n = 4096, 1000
    w = torch.randn(n, k, device="cuda")
    x = torch.randn(m, k, device="cuda").to(dtype)
    q, s = quantize_int8(w.to(dtype))
    out = w8a16.w8a16_matmul(x, q, s, out=poisoned(m, n, dtype, "cuda"))
    assert rel_err(out, w8a16.reference(x, q, s)) < tol
    for symmetric in (True, False):
        qw = quantize_int4(w.to(dtype), 128, symmetric)
        out = w4a16.w4a16_matmul(x, qw, out=poisoned(m, n, dtype, "cuda"))
        assert rel_err(out, w4a16.reference(x, qw)) < tol


@pytest.mark.gpu
def test_gpu_w4a16_gemv_takes_large_fp16_activations() -> None:
    """Activations of +-20,000 (outliers of the kind some models' MLPs produce): the PTX
    accumulates four (code - 8) / 16 * x terms in fp16, at most 40,000 here. With
    (code - 8) * x it reached 640,000 and turned the output to inf."""
    k, n = 1024, 512
    w = torch.randn(n, k, device="cuda") * 1e-3
    x = torch.randn(1, k, device="cuda")
    x[0, ::7] = 20000.0 * torch.sign(x[0, ::7])
    x = x.half()
    qw = quantize_int4(w.half(), 128, symmetric=True)
    out = w4a16.w4a16_matmul(x, qw, out=poisoned(1, n, torch.float16, "cuda"))
    assert torch.isfinite(out).all()
    assert rel_err(out, w4a16.reference(x, qw)) < KERNEL_TOL[torch.float16]
