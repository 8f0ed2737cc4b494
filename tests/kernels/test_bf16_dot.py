"""Cadence's bf16 dot GEMM (kernels/cpu/bf16_dot.py) beyond what every half format is held to
in test_half_linear.py: offered exactly where the CPU has AVX512-BF16, and a row's bits
the same whatever the thread count and in a process forked after the kernel ran."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from cadence.kernels.cpu import bf16_dot
from cadence.kernels.cpu.half_linear import BF16DOT, available
from tests.support.helpers import bits_after_fork, bits_at_threads, run_python

FLAGS = Path("/proc/cpuinfo").read_text().split() if platform.system() == "Linux" else []


def test_offered_exactly_where_the_cpu_has_avx512_bf16() -> None:
    assert available(BF16DOT) == ("avx512_bf16" in FLAGS)


needs_bf16dot = pytest.mark.skipif(not available(BF16DOT), reason="needs AVX512-BF16")


@needs_bf16dot
def test_packing_pads_columns_and_odd_k_with_zeros() -> None:
    weight = torch.randn(33, 7)
    packed = bf16_dot.pack(weight)
    assert packed.blocks.shape == (2, 4, 32) and (packed.out_features, packed.in_features) == (33, 7)
    halves = torch.from_numpy(packed.blocks).view(torch.bfloat16).view(2, 4, 32, 2)  # [block, pair, column, k]
    assert torch.equal(halves[0, :, 0, 0], weight[0, 0::2].bfloat16())  # column 0's even k
    assert not halves[1, :, 1:].any()  # columns 33 to 63 are padding
    assert not halves[:, 3, :, 1].any()  # k = 7, past the last, is padding
    x = torch.randn(5, 7).bfloat16()
    expected = x.double() @ weight.bfloat16().double().t()
    assert (bf16_dot.gemm(x, packed).double() - expected).abs().max() < 1e-5
    with pytest.raises(ValueError, match="columns"):
        bf16_dot.gemm(torch.randn(2, 8).bfloat16(), packed)
    with pytest.raises(ValueError, match="bf16"):
        bf16_dot.gemm(torch.randn(2, 7), packed)  # fp32 would read as pairs of garbage


@needs_bf16dot
def test_a_row_has_its_bits_alone_where_n_and_k_fill_no_block() -> None:
    gen = torch.Generator().manual_seed(4)
    weight = bf16_dot.pack(torch.randn(200, 73, generator=gen))
    x = torch.randn(40, 73, generator=gen).bfloat16()
    alone = torch.cat([bf16_dot.gemm(x[i : i + 1], weight) for i in range(40)])
    for start, m in ((0, 40), (3, 7), (11, 13), (1, 6), (5, 29)):
        assert torch.equal(bf16_dot.gemm(x[start : start + m], weight), alone[start : start + m]), (start, m)


_BITS = (
    "import hashlib, torch\n"
    "from cadence.kernels.cpu import bf16_dot\n"
    "gen = torch.Generator().manual_seed(3)\n"
    "weight = bf16_dot.pack(torch.randn(960, 576, generator=gen) / 20)\n"
    "x = torch.randn(37, 576, generator=gen).bfloat16()\n"
    # numpy's hash of the bytes: torch's own parallel ops would hang in a forked child.
    "bits = lambda: hashlib.sha256(bf16_dot.gemm(x, weight).numpy().tobytes()).hexdigest()\n"
)


@needs_bf16dot
def test_bits_do_not_depend_on_the_thread_count() -> None:
    assert bits_at_threads(_BITS, 1) == bits_at_threads(_BITS, 2)


@needs_bf16dot
def test_a_process_forked_after_the_kernel_ran_runs_it_serially_with_the_same_bits() -> None:
    assert bits_after_fork(_BITS) == "0 True"


@needs_bf16dot
def test_a_child_forked_after_one_kernel_ran_runs_the_other_serially() -> None:
    """numba ends a forked child that enters a parallel region once the parent's threads
    started, whichever kernel started them: the child runs every kernel's serial form."""
    code = _BITS + (
        "import os\n"
        "from cadence.kernels.cpu import paged_decode\n"
        "from cadence.kernels.cpu.paged_decode import GeneratedRows, attend_generated\n"
        "parent = bits()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    cache = torch.zeros(64, 1, 16)\n"
        "    query, out = torch.ones(1, 1, 16), torch.zeros(1, 1, 16)\n"
        "    rows = GeneratedRows.build([0], torch.zeros(1, 4, dtype=torch.int32), [5], None)\n"
        "    attend_generated(query, out, cache, cache, rows, 16, 0.25)\n"
        "    os._exit(0 if paged_decode.available() and bits() == parent else 3)\n"
        "print(os.waitpid(pid, 0)[1] >> 8)"
    )
    assert run_python(code) == "0"


@needs_bf16dot
def test_starting_the_kernel_keeps_torchs_thread_count() -> None:
    code = "import torch\nbefore = torch.get_num_threads()\n" + _BITS + "bits()\nprint(before, torch.get_num_threads())"
    assert run_python(code, OMP_NUM_THREADS="1") == "1 1"
