"""The CPU rotary kernel (kernels/cpu/rotary.py): the torch reference's bits for q and k
read from one projection's rows or from tensors of their own, on any thread count and in
a forked child; the torch ops wherever it does not apply; and the model's rotary call
taking it."""

from __future__ import annotations

import pytest
import torch

from cadence.engine.models.rotary import RotaryEmbedding
from cadence.kernels import layer_ops_reference as reference
from cadence.kernels.cpu import rotary as cpu_rotary
from tests.support.helpers import bits_after_fork, bits_at_threads, gen

needs_kernel = pytest.mark.skipif(cpu_rotary._rotate.function() is None, reason="numba is unavailable")


def _projection(t: int, heads: int, kv_heads: int, dim: int, seed: int) -> tuple[torch.Tensor, ...]:
    """q, k, v as the attention splits them: views of one ``[T, (H + 2 KV) * D]`` output."""
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=gen(seed))
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    return q.view(t, heads, dim), k.view(t, kv_heads, dim), v


@needs_kernel
@pytest.mark.parametrize("t,heads,kv_heads,dim", [(8, 4, 2, 16), (37, 9, 3, 64), (300, 8, 8, 128), (64, 6, 1, 10)])
def test_the_reference_bits_from_the_projection_rows(
    t: int, heads: int, kv_heads: int, dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, k, _ = _projection(t, heads, kv_heads, dim, seed=t)
    rope = RotaryEmbedding(dim, 4096, theta=10000.0)
    positions = torch.randint(0, 4096, (t,), generator=gen(1))
    cos_rows, sin_rows = reference.rotary_rows(positions, *_tables(rope), torch.float32)
    expected = reference.rotate(q, cos_rows, sin_rows), reference.rotate(k, cos_rows, sin_rows)
    factors = cpu_rotary.rotary_factors(cos_rows, sin_rows)
    # Views into the projection's rows (k at an offset, rows wider than q or k), and
    # tensors of their own (as a per-head norm returns them).
    for q_in, k_in in ((q, k), (q.contiguous(), k.contiguous())):
        got = cpu_rotary.rotate(q_in, k_in, factors)
        assert got is not None
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert got[0].is_contiguous() and got[1].is_contiguous()
    # The model's own call takes the kernel.
    calls: list[bool] = []
    real = cpu_rotary.rotate

    def spy(*args: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        out = real(*args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_rotary, "rotate", spy)
    rotated = rope.at(positions)(q, k)
    assert calls == [True]
    assert torch.equal(rotated[0], expected[0]) and torch.equal(rotated[1], expected[1])


def _tables(rope: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    rope.build("cpu")
    assert rope.cos is not None and rope.sin is not None
    return rope.cos, rope.sin


@needs_kernel
def test_the_torch_ops_serve_where_the_kernel_does_not_apply() -> None:
    q, k, _ = _projection(16, 4, 2, 16, seed=2)
    factors = torch.randn(16, 32, generator=gen(3))
    assert cpu_rotary.rotate(q, k, factors) is not None
    few_q, few_k, _ = _projection(cpu_rotary.MIN_ROWS - 1, 4, 2, 16, seed=2)
    assert cpu_rotary.rotate(few_q, few_k, factors[: cpu_rotary.MIN_ROWS - 1]) is None  # the torch ops are quicker
    assert cpu_rotary.rotate(q.bfloat16(), k.bfloat16(), factors) is None
    assert cpu_rotary.rotate(q, k, factors[:15]) is None  # fewer positions than tokens
    assert cpu_rotary.rotate(q, k[:15], factors) is None  # fewer k rows than q rows
    assert cpu_rotary.rotate(q, k, factors[:, :16]) is None  # factors of another head size
    assert cpu_rotary.rotate(q, k, torch.randn(32, 16, generator=gen(4)).t()) is None  # not contiguous
    strided = torch.randn(16, 16, 4, generator=gen(5)).transpose(1, 2)  # q's shape, a head's values 4 apart
    assert cpu_rotary.rotate(strided, k, factors) is None


_BITS = (
    "import hashlib, torch\n"
    "from cadence.kernels.cpu import rotary as cpu_rotary\n"
    "gen = torch.Generator().manual_seed(3)\n"
    "qkv = torch.randn(53, 15 * 64, generator=gen)\n"
    "q, k = qkv[:, :576].view(53, 9, 64), qkv[:, 576:768].view(53, 3, 64)\n"
    "factors = torch.randn(53, 128, generator=gen)\n"
    # numpy's hash of the bytes: torch's own parallel ops would hang in a forked child.
    "rotated = lambda: b''.join(t.numpy().tobytes() for t in cpu_rotary.rotate(q, k, factors))\n"
    "bits = lambda: hashlib.sha256(rotated()).hexdigest()\n"
)


@needs_kernel
def test_bits_do_not_depend_on_the_thread_count() -> None:
    assert bits_at_threads(_BITS, 1) == bits_at_threads(_BITS, 2)


@needs_kernel
def test_a_process_forked_after_the_kernel_ran_runs_it_serially_with_the_same_bits() -> None:
    assert bits_after_fork(_BITS) == "0 True"
