"""Cadence's bf16 dot GEMM (kernels/bf16_dot.py) beyond what every half format is held to
in test_half_linear.py: offered exactly where the CPU has AVX512-BF16, and a row's bits
the same whatever the thread count and in a process forked after the kernel ran."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cadence.kernels import bf16_dot
from cadence.kernels.half_linear import BF16DOT, available

FLAGS = Path("/proc/cpuinfo").read_text().split() if platform.system() == "Linux" else []


def test_offered_exactly_where_the_cpu_has_avx512_bf16() -> None:
    assert available(BF16DOT) == ("avx512_bf16" in FLAGS)


pytestmark_needs = pytest.mark.skipif(not available(BF16DOT), reason="needs AVX512-BF16")


def _python(code: str, **env: str) -> str:
    run = subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytestmark_needs
def test_packing_pads_columns_and_odd_k_with_zeros() -> None:
    weight = torch.randn(33, 7)
    packed = bf16_dot.pack(weight)
    assert packed.blocks.shape == (2, 4, 32) and (packed.out_features, packed.in_features) == (33, 7)
    x = torch.randn(5, 7).bfloat16()
    expected = x.double() @ weight.bfloat16().double().t()
    assert (bf16_dot.gemm(x, packed).double() - expected).abs().max() < 1e-5
    with pytest.raises(ValueError, match="columns"):
        bf16_dot.gemm(torch.randn(2, 8).bfloat16(), packed)


_BITS = (
    "import hashlib, torch\n"
    "from cadence.kernels import bf16_dot\n"
    "gen = torch.Generator().manual_seed(3)\n"
    "weight = bf16_dot.pack(torch.randn(960, 576, generator=gen) / 20)\n"
    "x = torch.randn(37, 576, generator=gen).bfloat16()\n"
    # numpy's hash of the bytes: torch's own parallel ops would hang in a forked child.
    "bits = lambda: hashlib.sha256(bf16_dot.gemm(x, weight).numpy().tobytes()).hexdigest()\n"
)


@pytestmark_needs
def test_bits_do_not_depend_on_the_thread_count() -> None:
    one = _python(_BITS + "print(bits())", OMP_NUM_THREADS="1")
    two = _python(_BITS + "torch.set_num_threads(2)\nprint(bits())", OMP_NUM_THREADS="2")
    assert one == two


@pytestmark_needs
def test_a_process_forked_after_the_kernel_ran_runs_it_serially_with_the_same_bits() -> None:
    code = _BITS + (
        "import os\n"
        "parent = bits()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if bits() == parent else 3)\n"
        "print(os.waitpid(pid, 0)[1] >> 8, bits() == parent)"
    )
    assert _python(code) == "0 True"


@pytestmark_needs
def test_starting_the_kernel_keeps_torchs_thread_count() -> None:
    code = "import torch\nbefore = torch.get_num_threads()\n" + _BITS + "bits()\nprint(before, torch.get_num_threads())"
    assert _python(code, OMP_NUM_THREADS="1") == "1 1"
