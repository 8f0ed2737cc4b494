"""The decoder's small-op kernels (RMSNorm with residual, rotary, SiLU-and-mul) against
their torch definitions in kernels/layer_ops_reference.py.

They round as torch rounds where it matters (RMSNorm's residual sum is bit-exact), so the
checks are tight: within float32 reduction-order, multiply-add or exp differences. Shapes
are ragged (dims that are not powers of two, odd head counts), inputs fresh per case,
outputs poisoned with NaN. Without CUDA they run in Triton's interpreter.
"""

from __future__ import annotations

import pytest
import torch

from cadence.kernels import layer_ops_reference as reference
from cadence.kernels.triton.rms_norm import rms_norm
from cadence.kernels.triton.rotary import apply_rotary
from cadence.kernels.triton.silu_and_mul import silu_and_mul
from tests.support.helpers import DEVICE, gen, rel_err

DTYPES = [torch.float16, torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
TOLERANCE = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6}


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=gen(seed)).to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 576), (3, 1000)])
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, rows: int, dim: int) -> None:
    x, residual = randn(rows, dim, dtype=dtype, seed=1), randn(rows, dim, dtype=dtype, seed=2)
    weight = (1 + 0.1 * randn(dim, dtype=torch.float32, seed=3)).to(dtype)
    out = torch.full_like(x, float("nan"))
    rms_norm(x, weight, 1e-5, out=out)
    assert rel_err(out, reference.rms_norm(x, weight, 1e-5)) < TOLERANCE[dtype]

    out = torch.full_like(x, float("nan"))
    normed, total = rms_norm(x, weight, 1e-5, residual, out=out)
    ref_normed, ref_total = reference.rms_norm(x, weight, 1e-5, residual)
    assert normed.data_ptr() == out.data_ptr()
    assert torch.equal(total, ref_total)  # one rounded add, as torch's
    assert rel_err(normed, ref_normed) < TOLERANCE[dtype]


def test_rms_norm_of_mixed_dtypes_takes_the_reference() -> None:
    x = randn(3, 64, dtype=torch.float16, seed=4)
    weight = randn(64, dtype=torch.float32, seed=5)  # the result is float32, as in torch
    assert torch.equal(rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (5, 1, 24)])
def test_rotary_in_place_on_views_of_the_fused_qkv(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    tokens, max_positions = 6, 50
    qkv = randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=6)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)  # strided views, as the model passes them
    k = k.view(tokens, kv_heads, head_dim)
    angles = torch.rand(max_positions, head_dim // 2, generator=gen(7)) * 6.3
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    positions = torch.tensor([0, 3, 49, 7, 7, 21], device=DEVICE)
    ref_q, ref_k = reference.rotary(positions, q.clone(), k.clone(), cos, sin)
    v_before = v.clone()
    out_q, out_k = apply_rotary(positions, q, k, cos, sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert rel_err(q, ref_q) < TOLERANCE[dtype] and rel_err(k, ref_k) < TOLERANCE[dtype]
    assert torch.equal(v, v_before)  # v, between k and the next token's q, is untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (5, 1536), (2, 1500)])
def test_silu_and_mul(dtype: torch.dtype, rows: int, inter: int) -> None:
    gate_up = 3 * randn(rows, 2 * inter, dtype=dtype, seed=8)
    out = torch.full((rows, inter), float("nan"), dtype=dtype, device=DEVICE)
    silu_and_mul(gate_up, out=out)
    assert rel_err(out, reference.silu_and_mul(gate_up)) < TOLERANCE[dtype]
