"""A dense GEMM whose every output row is the same bits whatever the number of rows.

    out[M, N] = x[M, K] @ weight[N, K].T (+ bias[N])

cuBLAS chooses its kernel, tile shape and split-K by the problem's M, so one token's row
of a linear layer changes in its last bits with the batch it runs in. Under
``--batch-invariant`` the engine sends dense linears here instead: one tile shape for
every M, no split-K, and each program walks K from 0 to K in ``BLOCK_K`` steps, so a row's
sum over K happens in one fixed order. ``tl.dot`` computes each output row from its own
input row only, so neither the other rows nor how many there are can reach it.

``BLOCK_M`` is also the fixed M tile the quantized kernels use in this mode
(``w8a16``, ``w4a16``, ``w8a8_fp8``): a tile's shape decides which MMA instructions
Triton emits, and those decide how a dot's K is summed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.triton.launch import as_rows, check_activations, triton_usable

# One configuration for every M. 64 rows keep a prefill's weight re-reads low; a decode
# step computes a mostly empty tile instead, which costs little next to reading the weight.
BLOCK_M = 64
BLOCK_N = 64
BLOCK_K = 64


def reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Plain-torch ``x @ weight.T + bias``, in fp32, cast to x's dtype."""
    y = x.float() @ weight.float().t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# M is not specialized: the kernel compiled for one row count serves every other.
@triton.jit(do_not_specialize=["M"])
def _batch_invariant_gemm_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_om,
    stride_on,
    HAS_BIAS: tl.constexpr,
    FP32_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (m, n) computes one [BLOCK_M, BLOCK_N] output tile over the whole of K."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    # A [BLOCK_K, BLOCK_N] view of the [N, K] weight, through its strides.
    w_ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = (k0 + offs_k) < K
        x = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if FP32_IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")  # fp32 asks for fp32, not TF32
        else:
            acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def batch_invariant_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``x [..., K]`` @ ``weight [N, K]``.T + ``bias [N]`` -> ``[..., N]`` in x's dtype, each row's
    bits independent of the other rows. The weight must be in x's dtype. CPU tensors
    without ``TRITON_INTERPRET=1`` take :func:`reference`. ``out`` (optional, ``[M, N]``,
    x's dtype) lets tests pre-fill it."""
    n, k = weight.shape
    if x.shape[-1] != k or (bias is not None and bias.shape != (n,)):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, weight {tuple(weight.shape)}")
    if weight.dtype != x.dtype:
        raise TypeError(f"weight {weight.dtype} and activations {x.dtype} differ")
    check_activations(x)
    x2, out, lead = as_rows(x, n, out)
    m = x2.shape[0]
    if m == 0:
        return out.reshape(*lead, n)
    if not triton_usable(x):
        out.copy_(reference(x2, weight, bias))
        return out.reshape(*lead, n)
    _batch_invariant_gemm_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
        x2,
        weight,
        weight if bias is None else bias,  # a dummy pointer, never read without a bias
        out,
        m,
        n,
        k,
        x2.stride(0),
        x2.stride(1),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        HAS_BIAS=bias is not None,
        FP32_IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
    )
    return out.reshape(*lead, n)
