"""Fused MoE: a SwiGLU expert FFN over routed tokens as two grouped GEMMs.

For tokens ``x [M, K]``, each routed to ``top_k`` experts with weights ``topk_weights``:

    out[t] = sum_j  topk_weights[t, j] * w2[e] @ (silu(g) * u),  [g; u] = w1[e] @ x[t],  e = topk_ids[t, j]

with ``w1[e]`` ``[2I, K]`` (gate rows first, then up, as Mixtral's w1/w3 or Qwen's
gate_proj/up_proj stacked) and ``w2[e]`` ``[K, I]``. The Triton path:

1. ``moe_align`` sorts the M * top_k (token, slot) *pairs* by expert and pads each
   expert's run to BLOCK_M rows (torch ops, no host sync; see ``moe_align.py``).
2. One launch of ``_moe_gemm_kernel`` over every expert's blocks computes gate and up
   for a column tile together (two accumulators sharing each x tile) and applies SwiGLU
   in registers, writing ``act [pairs, I]`` in x's dtype: no ``[pairs, 2I]`` buffer.
3. A second launch multiplies by ``w2``, scales by the routing weight and writes one row
   per pair to ``[M, top_k, K]``; ``sum(dim=1)`` reduces it. We chose this over atomic
   scatter-adds into ``[M, K]``: it is deterministic, needs no zero-fill, and avoids
   fp16/bf16 atomics; the extra buffer is top_k rows per token.

Weights: dense fp16/bf16/fp32 ``[E, N, K]``, :class:`Int8Experts` (per expert,
per output channel) or :class:`Int4Experts` (per expert, ``quant_formats``' int4 layout
stacked along a leading E). Quantized tiles are dequantized inside the K loop; int8's
per-channel scale multiplies the accumulator once at the end.

Rounding points, which :func:`reference` copies: fp32 accumulation; int4 weights are
rounded to x's dtype once; the activation and each pair's weighted output are rounded to
x's dtype; the top_k sum is fp32 and rounded once. Expert offloading maps global expert
ids to cache slots before calling (``slot_of[topk_ids]``); the kernels only see indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cadence.kernels.formats.quant_formats import (
    SYMMETRIC_ZERO,
    Int4Weight,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)
from cadence.kernels.triton.launch import triton_usable
from cadence.kernels.triton.moe_align import MoEAlignment, moe_align
from cadence.kernels.triton.w4a16 import _block_k_for, _dequant_tile

DENSE, INT8, INT4 = 0, 1, 2


@dataclass
class Int8Experts:
    """Per-expert, per-output-channel int8: ``qweight int8 [E, N, K]``, ``scale [E, N]``."""

    qweight: torch.Tensor
    scale: torch.Tensor

    @classmethod
    def quantize(cls, w: torch.Tensor) -> Int8Experts:
        pairs = [quantize_int8(we) for we in w]
        return cls(torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs]))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.stack([dequantize_int8(q, s, dtype) for q, s in zip(self.qweight, self.scale)])


@dataclass
class Int4Experts:
    """Per-expert group-wise int4, ``Int4Weight``'s layout stacked along a leading E.

    ``qweight int32 [E, K // 8, N]``, ``scales [E, K // group, N]``,
    ``zeros uint8 [E, K // group, N]`` or None (symmetric, zero point 8).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int

    @classmethod
    def stack(cls, experts: list[Int4Weight]) -> Int4Experts:
        """Stack per-expert weights (e.g. from ``from_gptq``); all symmetric or none."""
        zeros: torch.Tensor | None = None
        if any(e.zeros is not None for e in experts):
            zeros = torch.stack(
                [
                    torch.full(e.scales.shape, SYMMETRIC_ZERO, dtype=torch.uint8, device=e.scales.device)
                    if e.zeros is None
                    else e.zeros
                    for e in experts
                ]
            )
        return cls(
            torch.stack([e.qweight for e in experts]),
            torch.stack([e.scales for e in experts]),
            zeros,
            experts[0].group_size,
        )

    @classmethod
    def quantize(cls, w: torch.Tensor, group_size: int = 128, symmetric: bool = True) -> Int4Experts:
        return cls.stack([quantize_int4(we, group_size, symmetric) for we in w])

    def expert(self, e: int) -> Int4Weight:
        return Int4Weight(
            self.qweight[e], self.scales[e], None if self.zeros is None else self.zeros[e], self.group_size
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.stack([dequantize_int4(self.expert(e), dtype) for e in range(self.qweight.shape[0])])


ExpertWeights = torch.Tensor | Int8Experts | Int4Experts


def _dense(w: ExpertWeights, dtype: torch.dtype) -> torch.Tensor:
    """Dense fp32 ``[E, N, K]`` holding exactly the values the kernel multiplies by."""
    if isinstance(w, Int8Experts):
        return w.dequantize(torch.float32)  # the kernel scales the fp32 accumulator
    if isinstance(w, Int4Experts):
        return w.dequantize(dtype).float()  # the kernel rounds the tile to x's dtype
    return w.to(dtype).float()


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral/Qwen-MoE routing: fp32 softmax over all experts, then the top_k.

    ``renormalize`` divides the kept weights by their sum (Mixtral always; Qwen2/3-MoE
    when ``norm_topk_prob``). Returns ``topk_weights fp32 [M, top_k]`` and
    ``topk_ids int32 [M, top_k]``. The weights stay fp32 (HF casts them to the model
    dtype first); the kernel multiplies them into its fp32 accumulator.
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def reference(
    x: torch.Tensor, w1: ExpertWeights, w2: ExpertWeights, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Plain-torch MoE FFN (the module docstring's formula and rounding points)."""
    w1d, w2d = _dense(w1, x.dtype), _dense(w2, x.dtype)
    m, top_k = topk_ids.shape
    pair_out = torch.zeros(m, top_k, w2d.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(topk_ids).tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        gate, up = (x[tok].float() @ w1d[e].t()).chunk(2, dim=-1)
        act = (F.silu(gate) * up).to(x.dtype).float()
        y = (act @ w2d[e].t()) * topk_weights[tok, slot].float()[:, None]
        pair_out[tok, slot] = y.to(x.dtype).float()
    return pair_out.sum(dim=1).to(x.dtype)


@triton.jit
def _weight_tile(
    w_ptr,
    s_ptr,
    z_ptr,
    expert,
    k0,
    offs_k,
    offs_n,
    mask_n,
    K,
    N_ROW,
    stride_we,
    stride_wn,
    stride_wk,
    dtype,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SYM_ZERO: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Expert ``expert``'s weight rows k0 + offs_k x columns offs_n as ``[BLOCK_K, BLOCK_N]``."""
    e = expert.to(tl.int64)  # E * N * K can pass 2**31 elements
    if QUANT == 2:
        # int4 per expert: qweight [K // 8, N_ROW], scales/zeros [K // GROUP, N_ROW], contiguous.
        groups = K // GROUP
        w = _dequant_tile(
            w_ptr + e * (K // 8) * N_ROW,
            s_ptr + e * groups * N_ROW,
            z_ptr + e * groups * N_ROW,
            k0,
            offs_k,
            offs_n,
            mask_n,
            N_ROW,
            GROUP,
            HAS_ZEROS,
            SYM_ZERO,
            BLOCK_K,
            BLOCK_N,
            False,
        )
    else:
        kk = k0 + offs_k
        ptrs = w_ptr + e * stride_we + kk[:, None] * stride_wk + offs_n[None, :] * stride_wn
        w = tl.load(ptrs, mask=(kk < K)[:, None] & mask_n[None, :], other=0)
    return w.to(dtype)  # int8 -> fp16 is exact; int4 rounds once, like the reference


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    z_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    expert_ids_ptr,
    num_pairs,
    N,
    K,
    N_ROW,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_om,
    stride_on,
    A_ROW_DIV: tl.constexpr,
    SWIGLU: tl.constexpr,
    MUL_ROUTING: tl.constexpr,
    QUANT: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_ZEROS: tl.constexpr,
    SYM_ZERO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_IEEE: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N output tile of one expert's rows.

    Output columns are ``[0, N)``; with SWIGLU the weight has ``2N`` rows and columns
    n and N + n (gate and up) are combined. A row of ``a`` is ``pair // A_ROW_DIV``
    (top_k for the first GEMM, whose rows are tokens; 1 for the second). ``N_ROW`` is the
    weight's full output width, the row stride of the int4 layout.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(expert_ids_ptr + pid_m)
    if expert < 0:  # a block past the last expert's run: the buffers are worst-case sized
        return
    pairs = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    mask_m = pairs < num_pairs  # padding rows hold the sentinel num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)  # M * K can pass 2**31
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + kk[None, :] * stride_ak,
            mask=mask_m[:, None] & (kk < K)[None, :],
            other=0.0,
        )
        w = _weight_tile(
            w_ptr,
            s_ptr,
            z_ptr,
            expert,
            k0,
            offs_k,
            offs_n,
            mask_n,
            K,
            N_ROW,
            stride_we,
            stride_wn,
            stride_wk,
            a.dtype,
            QUANT,
            GROUP,
            HAS_ZEROS,
            SYM_ZERO,
            BLOCK_K,
            BLOCK_N,
        )
        if FP32_IEEE:  # fp32 activations ask for fp32 accuracy, not TF32
            acc = tl.dot(a, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
        if SWIGLU:
            w = _weight_tile(
                w_ptr,
                s_ptr,
                z_ptr,
                expert,
                k0,
                offs_k,
                offs_n + N,
                mask_n,
                K,
                N_ROW,
                stride_we,
                stride_wn,
                stride_wk,
                a.dtype,
                QUANT,
                GROUP,
                HAS_ZEROS,
                SYM_ZERO,
                BLOCK_K,
                BLOCK_N,
            )
            if FP32_IEEE:
                acc_up = tl.dot(a, w, acc_up, input_precision="ieee")
            else:
                acc_up = tl.dot(a, w, acc_up)
    if QUANT == 1:  # per-channel scale is constant along K: apply once
        s_row = s_ptr + expert.to(tl.int64) * stride_se
        acc = acc * tl.load(s_row + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if SWIGLU:
            acc_up = acc_up * tl.load(s_row + N + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    if SWIGLU:
        acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_ROUTING:
        acc = acc * tl.load(topk_w_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _shape(w: ExpertWeights) -> tuple[int, int, int]:
    """(E, N, K) of expert weights in any format."""
    if isinstance(w, Int4Experts):
        e, k8, n = w.qweight.shape
        return e, n, k8 * 8
    e, n, k = w.qweight.shape if isinstance(w, Int8Experts) else w.shape
    return e, n, k


def _launch(
    a: torch.Tensor,
    w: ExpertWeights,
    out: torch.Tensor,
    topk_weights: torch.Tensor,
    align: MoEAlignment,
    n_out: int,
    *,
    a_row_div: int,
    swiglu: bool,
    mul_routing: bool,
    block_n: int | None,
    block_k: int | None,
) -> None:
    _, n_row, k = _shape(w)
    common = dict(GROUP=1, HAS_ZEROS=False, SYM_ZERO=SYMMETRIC_ZERO)
    if isinstance(w, Int4Experts):
        if k % w.group_size or w.scales.shape[1:] != (k // w.group_size, n_row):
            raise ValueError(f"int4 experts: scales {tuple(w.scales.shape)} do not fit K={k}, group={w.group_size}")
        bk = _block_k_for(w.group_size, cap=block_k or 64)  # a K tile never spans groups
        if bk < 16:
            raise ValueError(f"group_size {w.group_size} must be a multiple of 16")
        ptr, scale = w.qweight.contiguous(), w.scales.contiguous()
        zeros = scale if w.zeros is None else w.zeros.contiguous()  # dummy pointer if symmetric
        strides, quant = (0, 0, 0), INT4
        common.update(GROUP=w.group_size, HAS_ZEROS=w.zeros is not None)
    else:
        bk = block_k or max(16, min(64, triton.next_power_of_2(k)))
        ptr = w.qweight if isinstance(w, Int8Experts) else w
        scale = w.scale.contiguous() if isinstance(w, Int8Experts) else ptr  # dummy if dense
        zeros, strides = scale, (ptr.stride(0), ptr.stride(1), ptr.stride(2))
        quant = INT8 if isinstance(w, Int8Experts) else DENSE
    bn = block_n or max(16, min(64, triton.next_power_of_2(n_out)))
    grid = (align.num_blocks, triton.cdiv(n_out, bn))
    _moe_gemm_kernel[grid](
        a,
        ptr,
        scale,
        zeros,
        out,
        topk_weights,
        align.sorted_ids,
        align.expert_ids,
        align.num_pairs,
        n_out,
        k,
        n_row,
        a.stride(0),
        a.stride(1),
        *strides,
        scale.stride(0),
        out.stride(0),
        out.stride(1),
        A_ROW_DIV=a_row_div,
        SWIGLU=swiglu,
        MUL_ROUTING=mul_routing,
        QUANT=quant,
        BLOCK_M=align.block_m,
        BLOCK_N=bn,
        BLOCK_K=bk,
        FP32_IEEE=a.dtype == torch.float32,
        **common,
    )


def _block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per block from the mean rows per expert: less padding when experts are sparse."""
    per_expert = num_pairs / max(num_experts, 1)
    return 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64  # tl.dot needs >= 16


def fused_moe(
    x: torch.Tensor,
    w1: ExpertWeights,
    w2: ExpertWeights,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """MoE FFN of ``x [M, K]`` (fp16/bf16/fp32) -> ``[M, K]`` in x's dtype.

    ``w1``: ``[E, 2I, K]`` (gate rows, then up), ``w2``: ``[E, K, I]``, each a dense tensor,
    :class:`Int8Experts` or :class:`Int4Experts`. ``topk_weights [M, top_k]`` and
    ``topk_ids [M, top_k]`` (ids in ``[0, E)``) come from :func:`route` or the caller.
    CPU tensors without ``TRITON_INTERPRET=1`` take :func:`reference`. ``out``
    (optional, ``[M, K]`` contiguous) lets tests pre-fill it with NaN.
    """
    e1, n1, k1 = _shape(w1)
    e2, n2, k2 = _shape(w2)
    m, k = x.shape
    if k1 != k or n2 != k or e1 != e2 or n1 != 2 * k2 or topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != m:
        raise ValueError(
            f"shape mismatch: x {tuple(x.shape)}, w1 {(e1, n1, k1)}, w2 {(e2, n2, k2)}, "
            f"topk {tuple(topk_ids.shape)}/{tuple(topk_weights.shape)}"
        )
    if x.dtype not in (torch.float16, torch.float32, torch.bfloat16):
        raise TypeError(f"activations must be fp16/bf16/fp32, got {x.dtype}")
    if out is None:
        out = torch.empty((m, k), dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    if not triton_usable(x):
        out.copy_(reference(x, w1, w2, topk_weights, topk_ids))
        return out
    top_k, inter = topk_ids.shape[1], k2
    align = moe_align(topk_ids, e1, block_m or _block_m_for(m * top_k, e1))
    weights = topk_weights.contiguous()
    act = torch.empty((m * top_k, inter), dtype=x.dtype, device=x.device)
    _launch(
        x,
        w1,
        act,
        weights,
        align,
        inter,
        a_row_div=top_k,
        swiglu=True,
        mul_routing=False,
        block_n=block_n,
        block_k=block_k,
    )
    pair_out = torch.empty((m, top_k, k), dtype=x.dtype, device=x.device)
    _launch(
        act,
        w2,
        pair_out.view(m * top_k, k),
        weights,
        align,
        k,
        a_row_div=1,
        swiglu=False,
        mul_routing=True,
        block_n=block_n,
        block_k=block_k,
    )
    out.copy_(pair_out.sum(dim=1, dtype=torch.float32))
    return out
