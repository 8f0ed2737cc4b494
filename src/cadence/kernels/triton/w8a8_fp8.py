"""W8A8 FP8 GEMM: per-token fp8 activations times a per-channel fp8 weight.

    out[M, N] = (xq[M, K] * x_scale[M, None]) @ (wq[N, K] * w_scale[N, None]).T

``fp8_matmul`` takes high-precision activations, quantizes them per token
(``fp8_format.quantize_fp8_per_token``) and then runs, in this order of preference:

* ``torch._scaled_mm`` (cuBLASLt / CUTLASS) on NVIDIA GPUs of compute capability 8.9+
  (Ada, Hopper, Blackwell) when K and N are multiples of 16, as it requires. Row-wise
  scales: ``scale_a [M, 1]`` and ``scale_b [1, N]``, float32, contiguous; the weight goes
  in column-major (``wq.t()``, no copy). It is asked for a bf16 output: older torch
  builds accept only bf16 for row-wise scaling, and newer ones fp16/fp32 only on some
  paths, so bf16 is the one output every build with row-wise fp8 has.
* the Triton kernel below anywhere else Triton runs (older GPUs, ragged shapes, the
  interpreter in tests). It reads the fp8 tensors as raw ``uint8`` bytes and decodes
  them with integer arithmetic, because Triton's own e4m3 type (``fp8e4nv``) is refused
  below sm_89, even for loads and bitcasts, and its interpreter rounds some values
  wrongly when encoding to it. Decoding is exact: every e4m3 value, subnormals
  included, is an fp16 value once scaled by 2^-8, so the tiles go through fp16
  ``tl.dot`` with an fp32 accumulator, and the exact products make it fp32-accurate.
* :func:`reference` on CPU tensors outside the interpreter (Triton cannot run there;
  ``Fp8Linear`` has its own CPU path and never comes here).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cadence.kernels.batch_invariant.triton_gemm import BLOCK_M as INVARIANT_BLOCK_M
from cadence.kernels.formats.fp8_format import quantize_fp8_per_token
from cadence.kernels.triton.fp8_bits import FP16_DECODE_DIVISOR, e4m3_bits_to_fp16
from cadence.kernels.triton.launch import check_activations, has_fp8_hardware, triton_usable

# Both decoded operands are FP16_DECODE_DIVISOR times too small, so the accumulator is
# its square too small.
_DECODE_UNDO = FP16_DECODE_DIVISOR**2
# _scaled_mm's row-wise path needs K and N to be multiples of this.
_SCALED_MM_ALIGN = 16


def reference(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """Plain-torch W8A8 FP8: widen both fp8 operands to fp32, scale, matmul in fp32."""
    x = xq.float() * x_scale.float()[:, None]
    w = wq.float() * w_scale.float()[:, None]
    return (x @ w.t()).to(out_dtype)


@triton.jit
def _w8a8_fp8_kernel(
    x_ptr,
    xs_ptr,
    w_ptr,
    ws_ptr,
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
    DECODE_UNDO: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
        # Masked bytes read as 0, the code of +0.0.
        x = e4m3_bits_to_fp16(tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0))
        w = e4m3_bits_to_fp16(tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0))
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk

    # Both scales are constant along K: apply them once, to the accumulator.
    x_scale = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    w_scale = tl.load(ws_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * (x_scale[:, None] * DECODE_UNDO) * w_scale[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def scaled_mm_usable(x: torch.Tensor, n: int, k: int) -> bool:
    """Whether ``torch._scaled_mm`` can serve this matmul (see the module docstring)."""
    if not x.is_cuda or torch.version.hip is not None or not hasattr(torch, "_scaled_mm"):
        return False  # ROCm's MI300 wants e4m3fnuz, a different format from ours
    if k % _SCALED_MM_ALIGN or n % _SCALED_MM_ALIGN:
        return False
    return has_fp8_hardware(x.device)


def _scaled_mm_rowwise(
    xq: torch.Tensor, x_scale: torch.Tensor, wq: torch.Tensor, w_scale: torch.Tensor
) -> torch.Tensor:
    """``torch._scaled_mm`` with row-wise scales; bf16 out (see the module docstring)."""
    return torch._scaled_mm(
        xq,
        wq.t(),
        scale_a=x_scale[:, None],
        scale_b=w_scale[None, :],
        out_dtype=torch.bfloat16,
        use_fast_accum=False,  # fp32 accumulation throughout
    )


def fp8_matmul(
    x: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    allow_scaled_mm: bool = True,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    batch_invariant: bool = False,
) -> torch.Tensor:
    """``x [..., K]`` (fp16/bf16/fp32), quantized per token, @ (``wq`` e4m3 ``[N, K]`` * ``w_scale [N]``).T.

    Returns ``[..., N]`` in x's dtype. ``out`` (optional, ``[M, N]`` contiguous, x's
    dtype) lets tests pre-fill it; ``allow_scaled_mm=False`` forces the Triton kernel
    where ``_scaled_mm`` would otherwise run (tests compare the two). ``batch_invariant``
    takes the Triton kernel with one M tile for every M (``_scaled_mm`` picks its kernel by
    M), so a row's bits do not depend on the other rows; the activations are quantized per
    token either way.
    """
    n, k = wq.shape
    if x.shape[-1] != k or w_scale.shape != (n,):
        raise ValueError(f"shape mismatch: x {tuple(x.shape)}, wq {tuple(wq.shape)}, w_scale {tuple(w_scale.shape)}")
    if wq.dtype != torch.float8_e4m3fn or w_scale.dtype != torch.float32:
        raise TypeError(f"expected a float8_e4m3fn weight and a float32 scale, got {wq.dtype} and {w_scale.dtype}")
    check_activations(x)
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if m == 0:
        return (x.new_empty((0, n)) if out is None else out).reshape(*lead, n)
    xq, x_scale = quantize_fp8_per_token(x2)
    if batch_invariant:
        allow_scaled_mm, block_m = False, INVARIANT_BLOCK_M
    if allow_scaled_mm and scaled_mm_usable(x2, n, k):
        y = _scaled_mm_rowwise(xq, x_scale, wq, w_scale).to(x.dtype)
        return (y if out is None else out.copy_(y)).reshape(*lead, n)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if not triton_usable(x):
        out.copy_(reference(xq, x_scale, wq, w_scale, x.dtype))
        return out.reshape(*lead, n)
    x_bits, w_bits = xq.view(torch.uint8), wq.view(torch.uint8)
    # tl.dot needs every block dim >= 16; larger M tiles only when there are rows to fill.
    bm = block_m or (16 if m <= 16 else 32 if m <= 32 else 64)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, block_n))
    _w8a8_fp8_kernel[grid](
        x_bits,
        x_scale,
        w_bits,
        w_scale,
        out,
        m,
        n,
        k,
        x_bits.stride(0),
        x_bits.stride(1),
        w_bits.stride(0),
        w_bits.stride(1),
        out.stride(0),
        out.stride(1),
        DECODE_UNDO=_DECODE_UNDO,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
    )
    return out.reshape(*lead, n)
