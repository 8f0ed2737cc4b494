"""W8A16 GEMM: fp16/fp32 activations times a per-output-channel int8 weight.

    out[M, N] = x[M, K] @ (qweight[N, K] * scale[N, None]).T

The weight is read in its nn.Linear layout ``int8 [N, K]`` (see ``quant_formats``); the
kernel loads a ``[BLOCK_K, BLOCK_N]`` tile through transposed strides, widens int8 to the
activation dtype (exact: |q| <= 127) and accumulates in fp32. The per-channel scale is
constant along K, so it multiplies the accumulator once at the end instead of every tile.
"""
from __future__ import annotations


import torch
import triton
import triton.language as tl

from cadence.kernels.launch import as_rows, check_activations, triton_usable


def reference(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Plain-torch W8A16: dequantize in fp32, matmul in fp32, cast to x's dtype."""
    w = qweight.float() * scale.float()[:, None]
    return (x.float() @ w.t()).to(x.dtype)


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk,
    stride_wn, stride_wk,
    stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP32_IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    # [BLOCK_K, BLOCK_N] view of the [N, K] weight: no transpose copy in memory.
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0)
        w = w.to(x.dtype)
        if FP32_IEEE:
            # fp32 activations ask for fp32 accuracy; the default would be TF32 on GPUs.
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    scale = tl.load(s_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    acc = acc * scale[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])



def w8a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """``x [..., K]`` (fp16/fp32) @ dequant(``qweight int8 [N, K]``, ``scale [N]``).T -> ``[..., N]``.

    CPU tensors without ``TRITON_INTERPRET=1`` take :func:`reference` (Triton cannot run).
    ``out`` (optional, ``[M, N]`` contiguous, x's dtype) lets callers and tests pre-fill it.
    """
    n, k = qweight.shape
    if x.shape[-1] != k or scale.shape != (n,):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, qweight {tuple(qweight.shape)}, scale {tuple(scale.shape)}")
    check_activations(x)
    x2, out, lead = as_rows(x, n, out)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, n)
    if not triton_usable(x):
        out.copy_(reference(x2, qweight, scale))
        return out.reshape(*lead, n)
    # tl.dot needs every block dim >= 16; larger M tiles only when there are rows to fill.
    bm = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, block_n))
    _w8a16_kernel[grid](
        x2, qweight, scale, out,
        m, n, k,
        x2.stride(0), x2.stride(1),
        qweight.stride(0), qweight.stride(1),
        out.stride(0), out.stride(1),
        BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k,
        FP32_IEEE=x.dtype == torch.float32,
    )
    return out.reshape(*lead, n)
