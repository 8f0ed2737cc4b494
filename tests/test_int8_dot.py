"""Cadence's int8 dot GEMM for int4 weights (kernels/int8_dot.py): offered where the CPU
has AVX2; activations quantized per block of 32 exactly as a torch reference does; each
output the exact integer block sums scaled in fp32; a row's bits its own at any M,
thread count and in a forked child; and an int4 layer served by it close to its dense
values."""

from __future__ import annotations

import platform
from pathlib import Path

import pytest
import torch

from cadence.engine.quantization.cpu_kernels import INT8DOT
from cadence.engine.quantization.linear import Int4Linear, Int4Method
from cadence.kernels import int8_dot
from helpers import run_python

FLAGS = Path("/proc/cpuinfo").read_text().split() if platform.system() == "Linux" else []
BLOCK = int8_dot.BLOCK


def test_offered_exactly_where_the_cpu_has_avx2() -> None:
    assert int8_dot.hardware_ready() == ("avx2" in FLAGS)


needs_int8dot = pytest.mark.skipif(not int8_dot.hardware_ready(), reason="needs AVX2")


def _weight(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8)
    scales = torch.rand(n, k // BLOCK, generator=gen) / 50
    offsets = -8 * scales + torch.randn(n, k // BLOCK, generator=gen) / 500
    return codes, scales, offsets


def _reference_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel's quantizer must give, in torch: per block, d = max|a| / 127,
    qa = round-half-even(a * (127 / max|a|)), and the fp32 sum of a taken in order."""
    m, k = x.shape
    blocks = x.view(m, k // BLOCK, BLOCK)
    peak = blocks.abs().amax(-1)
    inverse = torch.where(peak > 0, torch.tensor(127.0) / peak, torch.zeros(()))
    qa = torch.round(blocks * inverse.unsqueeze(-1)).to(torch.int8).view(m, k)
    total = torch.zeros(m, k // BLOCK)
    for j in range(BLOCK):
        total = total + blocks[..., j]
    return qa, torch.stack([peak / 127.0, total], dim=-1)


@needs_int8dot
def test_activations_quantize_as_the_reference_does() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4 * BLOCK, generator=gen) * torch.logspace(-3, 2, 9).unsqueeze(1)
    x[2, :BLOCK] = 0  # an all-zero block: scale 0, codes 0
    x[3, 5] = 1e4  # an outlier squeezes its block's other codes
    qa, fields = int8_dot.quantize(x)
    expected_qa, expected_fields = _reference_quantize(x)
    assert torch.equal(qa, expected_qa)
    assert torch.equal(fields, expected_fields)
    assert int(qa.abs().max()) == 127 and not qa[2, :BLOCK].any()


def _exact(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The kernel's formula in float64 from the same quantized activations."""
    qa, fields = int8_dot.quantize(x)
    m, k = x.shape
    kb = k // BLOCK
    integer = (qa.long().view(m, 1, kb, BLOCK) * codes.long().view(1, -1, kb, BLOCK)).sum(-1).double()
    d, total = fields[..., 0].double().unsqueeze(1), fields[..., 1].double().unsqueeze(1)
    return (integer * scales.double() * d + offsets.double() * total).sum(-1)


@needs_int8dot
@pytest.mark.parametrize(("n", "k", "m"), [(16, 32, 1), (40, 64, 5), (200, 96, 37), (960, 576, 7)])
def test_the_product_is_the_exact_block_sums_scaled_in_fp32(n: int, k: int, m: int) -> None:
    codes, scales, offsets = _weight(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = int8_dot.gemm(x, int8_dot.pack(codes, scales, offsets))
    assert out.shape == (m, n) and out.dtype == torch.float32
    exact = _exact(x, codes, scales, offsets)
    # fp32 rounding of K / 32 block terms, each well within 1e-6 of the output's scale.
    assert (out.double() - exact).abs().max() <= 1e-6 * exact.abs().max() * (k // BLOCK), (out, exact)
    # And close to the unquantized product: the activations' 8-bit blocks are the only loss.
    dense = (codes.float().view(n, -1, BLOCK) * scales.unsqueeze(-1) + offsets.unsqueeze(-1)).view(n, k)
    full = x.double() @ dense.double().t()
    assert (out.double() - full).norm() <= 0.03 * full.norm()


@needs_int8dot
def test_packing_checks_its_input_and_pads_columns() -> None:
    codes, scales, offsets = _weight(20, 64, seed=2)
    packed = int8_dot.pack(codes, scales, offsets)
    assert packed.codes.shape == (2, 2 * int8_dot.BLOCK_BYTES) and packed.out_features == 20
    assert packed.codes.nbytes + packed.scales.nbytes == int8_dot.packed_bytes(20, 64)
    fields = torch.from_numpy(packed.scales).view(2, 2, 2, 16)  # [block, kb, scale/offset, column]
    assert torch.equal(fields[0, 1, 0], scales[:16, 1]) and torch.equal(fields[1, 0, 1, :4], offsets[16:, 0])
    assert not fields[1, :, :, 4:].any()  # columns 20 to 31 are padding
    with pytest.raises(ValueError, match="multiple of 32"):
        int8_dot.pack(codes[:, :48], scales[:, :1], offsets[:, :1])
    with pytest.raises(ValueError, match="4-bit"):
        int8_dot.pack(codes + 16, scales, offsets)
    with pytest.raises(ValueError, match="fp32"):
        int8_dot.gemm(torch.randn(2, 64).bfloat16(), packed)


@needs_int8dot
def test_a_row_has_its_bits_alone_at_any_batch() -> None:
    codes, scales, offsets = _weight(200, 96, seed=4)
    weight = int8_dot.pack(codes, scales, offsets)
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([int8_dot.gemm(x[i : i + 1], weight) for i in range(300)])
    for start, m in ((0, 300), (3, 7), (11, 13), (1, 6), (5, 29), (40, 4), (2, 3)):
        assert torch.equal(int8_dot.gemm(x[start : start + m], weight), alone[start : start + m]), (start, m)


_BITS = (
    "import hashlib, torch\n"
    "from cadence.kernels import int8_dot\n"
    "gen = torch.Generator().manual_seed(3)\n"
    "codes = torch.randint(0, 16, (960, 576), generator=gen, dtype=torch.uint8)\n"
    "scales = torch.rand(960, 18, generator=gen) / 50\n"
    "weight = int8_dot.pack(codes, scales, -8 * scales)\n"
    "x = torch.randn(37, 576, generator=gen)\n"
    # numpy's hash of the bytes: torch's own parallel ops would hang in a forked child.
    "bits = lambda: hashlib.sha256(int8_dot.gemm(x, weight).numpy().tobytes()).hexdigest()\n"
)


@needs_int8dot
def test_bits_do_not_depend_on_the_thread_count() -> None:
    one = run_python(_BITS + "print(bits())", OMP_NUM_THREADS="1")
    two = run_python(_BITS + "torch.set_num_threads(2)\nprint(bits())", OMP_NUM_THREADS="2")
    assert one == two


@needs_int8dot
def test_a_process_forked_after_the_kernel_ran_runs_it_serially_with_the_same_bits() -> None:
    code = _BITS + (
        "import os\n"
        "parent = bits()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if bits() == parent else 3)\n"
        "print(os.waitpid(pid, 0)[1] >> 8, bits() == parent)"
    )
    assert run_python(code) == "0 True"


@needs_int8dot
@pytest.mark.parametrize("group_size", [32, 128])
def test_an_int4_layer_on_int8dot_reads_its_own_codes(group_size: int) -> None:
    """The held copy comes from the CPU layout's codes, scales and zero terms: the values
    the dense chunks hold."""
    gen = torch.Generator().manual_seed(group_size)
    linear = torch.nn.Linear(256, 128, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(128, 256, generator=gen) / 16)
    layer = Int4Linear.from_linear(linear, group_size=group_size, symmetric=False)
    method = layer.method
    assert isinstance(method, Int4Method)
    assert INT8DOT in method.cpu_kernels(layer)
    x = torch.randn(11, 256, generator=gen)
    out = method.run_cpu_kernel(layer, x, INT8DOT)
    dense = method.dense_chunk_maker(layer, torch.float32)(0, 128)
    full = x.double() @ dense.double().t()
    assert (out.double() - full).norm() <= 0.03 * full.norm()
    # One-hot rows read the held values back: a lone 1.0 quantizes to 127 at scale 1/127.
    held = method.run_cpu_kernel(layer, torch.eye(256), INT8DOT)
    assert torch.allclose(held, dense.t(), rtol=1e-6, atol=1e-6 * float(dense.abs().max()))
