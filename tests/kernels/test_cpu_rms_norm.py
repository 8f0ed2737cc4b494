"""The CPU RMSNorm kernel (kernels/cpu/rms_norm.py): the torch reference's values with the
residual added bit for bit, each row's bits the same alone and in any batch, on any
thread count and in a forked child; the torch ops wherever it does not apply; and the
model's hidden-state norms taking it."""

from __future__ import annotations

import pytest
import torch

from cadence.kernels import layer_ops
from cadence.kernels import layer_ops_reference as reference
from cadence.kernels.cpu import rms_norm as cpu_rms_norm
from tests.support.helpers import bits_after_fork, bits_at_threads, gen, rel_err

needs_kernel = pytest.mark.skipif(cpu_rms_norm._kernel.function() is None, reason="numba is unavailable")


@needs_kernel
@pytest.mark.parametrize("rows,cols", [(1, 576), (16, 576), (37, 64), (300, 100), (5, 7)])
def test_the_references_values_and_sum(rows: int, cols: int) -> None:
    x, residual = (torch.randn(rows, cols, generator=gen(seed)) * 3 for seed in (1, 2))
    weight = torch.randn(cols, generator=gen(3))
    normed, summed = cpu_rms_norm.rms_norm(x, weight, 1e-5, residual)
    expected, expected_sum = reference.rms_norm(x, weight, 1e-5, residual)
    assert torch.equal(summed, expected_sum)  # the residual add rounds as torch's
    assert rel_err(normed, expected) < 1e-6  # only the sum of squares' order differs
    alone = cpu_rms_norm.rms_norm(x, weight, 1e-5)
    assert rel_err(alone, reference.rms_norm(x, weight, 1e-5)) < 1e-6


@needs_kernel
def test_a_rows_bits_do_not_depend_on_its_batch() -> None:
    x, residual = (torch.randn(64, 576, generator=gen(seed)) for seed in (4, 5))
    weight = torch.randn(576, generator=gen(6))
    together, _ = cpu_rms_norm.rms_norm(x, weight, 1e-5, residual)
    for row in (0, 17, 63):
        alone, _ = cpu_rms_norm.rms_norm(x[row : row + 1].clone(), weight, 1e-5, residual[row : row + 1].clone())
        assert torch.equal(alone[0], together[row])


@needs_kernel
def test_the_hidden_state_norms_take_it_and_other_inputs_the_torch_ops() -> None:
    x, weight = torch.randn(8, 64, generator=gen(7)), torch.randn(64, generator=gen(8))
    assert cpu_rms_norm.applies(x, weight, None) and cpu_rms_norm.applies(x, weight, x)
    taken = layer_ops.rms_norm(x, weight, 1e-6)
    assert isinstance(taken, torch.Tensor) and torch.equal(taken, cpu_rms_norm.rms_norm(x, weight, 1e-6))
    heads = torch.randn(8, 96, generator=gen(9))[:, :64].reshape(8, 4, 16)  # a per-head norm's strided view
    assert not cpu_rms_norm.applies(heads, torch.ones(16), None)
    kept = layer_ops.rms_norm(heads, torch.ones(16), 1e-6)
    assert isinstance(kept, torch.Tensor) and torch.equal(kept, reference.rms_norm(heads, torch.ones(16), 1e-6))
    assert not cpu_rms_norm.applies(x.bfloat16(), weight.bfloat16(), None)
    assert not cpu_rms_norm.applies(x[:, :32], weight[:32], None)  # not contiguous


_BITS = (
    "import hashlib, torch\n"
    "from cadence.kernels.cpu import rms_norm as cpu_rms_norm\n"
    "gen = torch.Generator().manual_seed(3)\n"
    "x, r = torch.randn(53, 576, generator=gen), torch.randn(53, 576, generator=gen)\n"
    "w = torch.randn(576, generator=gen)\n"
    "normed = lambda: b''.join(t.numpy().tobytes() for t in cpu_rms_norm.rms_norm(x, w, 1e-5, r))\n"
    "bits = lambda: hashlib.sha256(normed()).hexdigest()\n"
)


@needs_kernel
def test_bits_do_not_depend_on_the_thread_count() -> None:
    assert bits_at_threads(_BITS, 1) == bits_at_threads(_BITS, 2)


@needs_kernel
def test_a_process_forked_after_the_kernel_ran_runs_it_serially_with_the_same_bits() -> None:
    assert bits_after_fork(_BITS) == "0 True"
