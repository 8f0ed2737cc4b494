"""Fused MoE: routing, the expert-sorted alignment, and the grouped-GEMM kernels.

Without CUDA the Triton kernels run under TRITON_INTERPRET=1 on CPU tensors (conftest.py
sets it before triton is imported). Shapes are tiny and ragged, router logits switch some
experts off so they receive no tokens, and outputs are pre-filled with NaN, so an element
the kernels forget to write fails the comparison.

Tolerances (relative Frobenius error ||out - ref|| / ||ref||):
* kernel vs ``fused_moe.reference`` on the same (dequantized) weights: fp32 1e-5, fp16
  2e-3 -- the reference copies the kernel's rounding points, so only accumulation order
  differs;
* quantized reference vs dense reference: int8 < 3e-2, int4 group 32 < 0.35. Both GEMMs
  are lossy and SwiGLU multiplies two perturbed values, so the error is about sqrt(2)x
  a single int4 GEMM's; over 180 random draws of these shapes the mean (max) was
  int8 0.010 (0.016), int4 symmetric 0.17 (0.31), int4 zero-point 0.14 (0.22).
"""

from __future__ import annotations

import pytest
import torch

from cadence.kernels.formats.quant_formats import quantize_int4
from cadence.kernels.triton import fused_moe as fm
from cadence.kernels.triton.moe_align import max_padded_pairs, moe_align
from tests.support.helpers import KERNEL_TOL, gen, poisoned, rel_err

QUANT_TOL = {"int8": 3e-2, "int4_sym": 0.35, "int4_zp": 0.35}
FORMATS = ["dense", "int8", "int4_sym", "int4_zp"]


def make_weights(
    e: int, k: int, inter: int, dtype: torch.dtype, g: torch.Generator, device: str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    # Scaled so activations stay O(1) and fp16 neither overflows nor underflows.
    w1 = torch.randn(e, 2 * inter, k, generator=g) / k**0.5
    w2 = torch.randn(e, k, inter, generator=g) / inter**0.5
    return w1.to(device, dtype), w2.to(device, dtype)


def quantize(w: torch.Tensor, fmt: str, group: int = 32) -> fm.ExpertWeights:
    if fmt == "dense":
        return w
    if fmt == "int8":
        return fm.Int8Experts.quantize(w)
    return fm.Int4Experts.quantize(w, group, symmetric=fmt == "int4_sym")


def routed(
    m: int, e: int, top_k: int, g: torch.Generator, dead: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random routing in which the ``dead`` experts receive no tokens."""
    logits = torch.randn(m, e, generator=g)
    logits[:, list(dead)] = float("-inf")
    return fm.route(logits, top_k, renormalize=True)


# ---------------------------------------------------------------- routing


@pytest.mark.parametrize("renormalize", [True, False])
def test_route_is_softmax_then_topk(renormalize: bool) -> None:
    logits = torch.randn(7, 8, generator=gen(1)).half()
    weights, ids = fm.route(logits, 2, renormalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32 and ids.shape == (7, 2)
    probs = torch.softmax(logits.float(), dim=-1)
    assert torch.equal(ids.long(), probs.argsort(dim=-1, descending=True)[:, :2])
    kept = probs.gather(1, ids.long())
    expected = kept / kept.sum(-1, keepdim=True) if renormalize else kept
    torch.testing.assert_close(weights, expected)
    assert (weights[:, 0] >= weights[:, 1]).all()


# ---------------------------------------------------------------- alignment


@pytest.mark.parametrize(
    "m,e,top_k,block_m", [(1, 4, 2, 16), (13, 8, 2, 16), (40, 4, 3, 16), (5, 8, 1, 32), (0, 4, 2, 16)]
)
def test_moe_align_invariants(m: int, e: int, top_k: int, block_m: int) -> None:
    _, ids = routed(m, e, top_k, gen(m + e), dead=(1,))
    al = moe_align(ids, e, block_m)
    n = m * top_k
    sorted_ids, expert_ids = al.sorted_ids.long(), al.expert_ids.long()
    assert sorted_ids.numel() == max_padded_pairs(n, e, block_m) == al.num_blocks * block_m
    real = sorted_ids[sorted_ids < n]
    assert sorted(real.tolist()) == list(range(n))  # every pair exactly once
    assert ((sorted_ids < n) | (sorted_ids == n)).all()  # the rest is the sentinel
    flat = ids.reshape(-1).long()
    counts = torch.bincount(flat, minlength=e)
    used = int(((counts + block_m - 1) // block_m).sum())
    assert int(al.num_tokens_post_padded) == used * block_m
    assert (expert_ids[used:] == -1).all() and (sorted_ids[used * block_m :] == n).all()
    assert torch.equal(expert_ids[:used], expert_ids[:used].sort().values)  # grouped by expert
    assert 1 not in expert_ids.tolist()  # an empty expert gets no block
    for b in range(used):
        rows = sorted_ids[b * block_m : (b + 1) * block_m]
        rows = rows[rows < n]
        assert rows.numel() > 0 and (flat[rows] == expert_ids[b]).all()
        assert torch.equal(rows, rows.sort().values)  # stable: pair order within an expert


def test_moe_align_rejects_bad_ids() -> None:
    with pytest.raises(ValueError, match="topk_ids"):
        moe_align(torch.tensor([[0, 4]]), 4, 16)


# ---------------------------------------------------------------- kernels vs reference


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,e,k,inter", [(1, 4, 32, 64), (5, 8, 64, 32), (13, 6, 64, 64)])
def test_fused_moe_matches_reference(fmt: str, dtype: torch.dtype, m: int, e: int, k: int, inter: int) -> None:
    g = gen(100 * m + e + k + FORMATS.index(fmt))
    w1, w2 = make_weights(e, k, inter, dtype, g)
    x = torch.randn(m, k, generator=g).to(dtype)
    weights, ids = routed(m, e, 2, g, dead=(0, e - 1))
    q1, q2 = quantize(w1, fmt), quantize(w2, fmt)
    out = fm.fused_moe(x, q1, q2, weights, ids, out=poisoned(m, k, dtype))
    ref = fm.reference(x, q1, q2, weights, ids)
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_err(out, ref) < KERNEL_TOL[dtype]
    if fmt != "dense":
        assert rel_err(ref, fm.reference(x, w1, w2, weights, ids)) < QUANT_TOL[fmt]


def test_reference_is_the_moe_formula() -> None:
    """The reference against a literal per-token loop, in fp32 (no rounding points)."""
    g = gen(3)
    w1, w2 = make_weights(4, 32, 16, torch.float32, g)
    x = torch.randn(5, 32, generator=g)
    weights, ids = routed(5, 4, 2, g)
    expected = torch.zeros(5, 32)
    for t in range(5):
        for j in range(2):
            gate, up = (w1[ids[t, j]] @ x[t]).chunk(2)
            expected[t] += weights[t, j] * (w2[ids[t, j]] @ (torch.nn.functional.silu(gate) * up))
    assert rel_err(fm.reference(x, w1, w2, weights, ids), expected) < 1e-6


@pytest.mark.parametrize("fmt", ["dense", "int8", "int4_zp"])
def test_fused_moe_ragged_tiles_and_odd_routing(fmt: str) -> None:
    """Small forced tiles (several N and K tiles, ragged I), top_k 1 and 3, one hot expert."""
    g = gen(7)
    dtype = torch.float16
    k, inter = (48, 24) if fmt != "int4_zp" else (64, 32)  # int4 needs K, I multiples of the group
    w1, w2 = make_weights(5, k, inter, dtype, g)
    q1, q2 = quantize(w1, fmt), quantize(w2, fmt)
    x_wide = torch.randn(13, k + 8, generator=g).to(dtype)
    x = x_wide[:, 4 : k + 4]  # a strided view: row stride k + 8
    for top_k, dead in ((1, (0, 1, 2, 4)), (3, (2,))):  # top_k 1: every token on expert 3
        weights, ids = routed(13, 5, top_k, g, dead)
        for tiles in (dict(block_m=16, block_n=16, block_k=16), dict(block_m=32)):
            out = fm.fused_moe(x, q1, q2, weights, ids, out=poisoned(13, k, dtype), **tiles)
            assert rel_err(out, fm.reference(x, q1, q2, weights, ids)) < KERNEL_TOL[dtype], (top_k, tiles)


def test_int4_experts_stack_mixed_symmetry() -> None:
    """Stacking a symmetric expert with a zero-point one materializes zero point 8."""
    w = torch.randn(2, 24, 64, generator=gen(9))
    experts = [quantize_int4(w[0], 32, symmetric=True), quantize_int4(w[1], 32, symmetric=False)]
    stacked = fm.Int4Experts.stack(experts)
    assert stacked.zeros is not None and stacked.qweight.shape == (2, 8, 24)
    assert (stacked.zeros[0] == 8).all()
    dense = stacked.dequantize(torch.float32)
    for i, expert in enumerate(experts):
        assert torch.equal(dense[i], fm.Int4Experts.stack([expert]).dequantize(torch.float32)[0])


def test_cpu_without_interpreter_falls_back_to_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    g = gen(12)
    w1, w2 = make_weights(4, 32, 32, torch.float32, g)
    x = torch.randn(5, 32, generator=g)
    weights, ids = routed(5, 4, 2, g)
    assert torch.equal(fm.fused_moe(x, w1, w2, weights, ids), fm.reference(x, w1, w2, weights, ids))


def test_fused_moe_validates_shapes() -> None:
    w1, w2 = make_weights(4, 32, 16, torch.float32, gen(13))
    weights, ids = routed(3, 4, 2, gen(14))
    with pytest.raises(ValueError, match="shape mismatch"):
        fm.fused_moe(torch.randn(3, 16), w1, w2, weights, ids)
    with pytest.raises(ValueError, match="shape mismatch"):
        fm.fused_moe(torch.randn(3, 32), w1, w2[:, :, :8], weights, ids)
    assert fm.fused_moe(torch.randn(0, 32), w1, w2, weights[:0], ids[:0]).shape == (0, 32)


# ---------------------------------------------------------------- GPU only


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 64, 300])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_fused_moe_matches_reference(dtype: torch.dtype, m: int, fmt: str) -> None:
    tol = 2e-3 if dtype == torch.float16 else 1e-2
    e, k, inter = 8, 1024, 512
    g = gen(m)
    w1, w2 = make_weights(e, k, inter, dtype, g, "cuda")
    x = torch.randn(m, k, generator=g).to("cuda", dtype)
    weights, ids = routed(m, e, 2, g, dead=(5,))
    weights, ids = weights.cuda(), ids.cuda()
    q1, q2 = quantize(w1, fmt, group=128), quantize(w2, fmt, group=128)
    out = fm.fused_moe(x, q1, q2, weights, ids, out=poisoned(m, k, dtype, "cuda"))
    assert torch.isfinite(out).all()
    assert rel_err(out, fm.reference(x, q1, q2, weights, ids)) < tol
