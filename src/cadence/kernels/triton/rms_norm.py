"""RMSNorm in one Triton kernel, optionally fused with the residual add before it.

A decoder layer's norms were eight small torch kernels each (cast, square, mean, add,
rsqrt, multiply, cast, weight), and the residual add one more: on a GPU each costs a
launch and a round trip through memory for a few kilobytes of work. Here one program
normalizes one row, reading it once.

Rounding follows the torch code exactly (transformers' order): the residual sum is
rounded to the activation dtype, normalized in float32, rounded, then multiplied by the
weight and rounded again.
"""

from __future__ import annotations

from typing import overload

import torch
import triton
import triton.language as tl

from cadence.kernels.layer_ops_reference import rms_norm as reference


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    dim,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # torch's rounded add
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)
    normed = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: None = None, *, out: torch.Tensor | None = None
) -> torch.Tensor: ...
@overload
def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor, *, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What ``reference`` computes, for ``x [..., dim]`` (and ``residual`` of its shape)
    in the weight's dtype, as one launch. Other dtype mixes go to ``reference``.
    ``out`` (contiguous, x's shape) lets tests poison the output."""
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return reference(x, weight, eps, residual)
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(rows.shape, dtype=x.dtype, device=x.device) if out is None else out.view(rows.shape)
    total = res = out  # placeholders when there is no residual: never read or written
    if residual is not None:
        res = residual.reshape(-1, dim).contiguous()
        total = torch.empty_like(out)
    if rows.shape[0]:
        block = triton.next_power_of_2(dim)
        _rms_norm_kernel[(rows.shape[0],)](
            rows,
            res,
            weight,
            out,
            total,
            dim,
            eps,
            rows.stride(0),
            res.stride(0),
            out.stride(0),
            total.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=min(16, max(1, block // 256)),
        )
    normed = out.view(x.shape)
    return normed if residual is None else (normed, total.view(x.shape))


__all__ = ["reference", "rms_norm"]
