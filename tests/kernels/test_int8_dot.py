"""Cadence's integer GEMM for int4 weights (kernels/cpu/int8_dot.py), at one and two int8
levels of activations: offered where the CPU has AVX2; activations quantized per block of
32 exactly as a torch reference does; each output the exact integer block sums scaled in
fp32; a row's bits its own at any M, thread count and in a forked child; an int4 layer
served by it close to its dense values; both only for a user who names one."""

from __future__ import annotations

import platform
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from cadence.engine.quantization.linear import Int4Linear, Int4Method
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.kernels.cpu import int8_dot, int8_quantize
from cadence.kernels.cpu.kernel_names import INT8DOT, INT8X2DOT
from tests.support.helpers import bits_after_fork, bits_at_threads, load_llama

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


def _reference_quantize(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel's quantizer must give, in torch: per block and level, of what is
    left (the value, then the first level's remainder), d = max|left| / 127 and
    q = round-half-even(left * (127 / max|left|)); and the sum over levels of d * sum(q),
    each integer sum exact, in level order."""
    m, k = x.shape
    left = x.view(m, k // BLOCK, BLOCK)
    codes, fields = [], []
    total = torch.zeros(m, k // BLOCK)
    for _ in range(levels):
        peak = left.abs().amax(-1)
        inverse = torch.where(peak > 0, torch.tensor(127.0) / peak, torch.zeros(()))
        q = torch.round(left * inverse.unsqueeze(-1)).to(torch.int8)
        d = peak / 127.0
        codes.append(q.view(m, k))
        fields.append(d)
        total = total + d * q.sum(-1, dtype=torch.int32).float()
        left = x.view(m, k // BLOCK, BLOCK) - d.unsqueeze(-1) * q.float()
    return torch.cat(codes, dim=1), torch.stack([*fields, total], dim=-1)


@needs_int8dot
@pytest.mark.parametrize("levels", int8_quantize.LEVELS)
def test_activations_quantize_as_the_reference_does(levels: int) -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 4 * BLOCK, generator=gen) * torch.logspace(-3, 2, 9).unsqueeze(1)
    x[2, :BLOCK] = 0  # an all-zero block: scale 0, codes 0
    x[3, 5] = 1e4  # an outlier squeezes its block's other codes
    qa, fields = int8_quantize.quantize(x, levels)
    expected_qa, expected_fields = _reference_quantize(x, levels)
    assert torch.equal(qa, expected_qa)
    assert torch.equal(fields, expected_fields)
    assert int(qa.abs().max()) == 127 and not qa[2, :BLOCK].any()
    restored = sum(
        qa[:, i * 4 * BLOCK : (i + 1) * 4 * BLOCK].float().view(9, 4, BLOCK) * fields[..., i : i + 1]
        for i in range(levels)
    )
    # Each level takes the error down 254-fold: a level's remainder is at most half its step.
    bound = fields[..., 0:1] * 127 / (2 * 254 ** (levels - 1)) / 127 * 1.0001
    assert ((restored - x.view(9, 4, BLOCK)).abs() <= bound).all()


def _exact(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, levels: int
) -> torch.Tensor:
    """The kernel's formula in float64 from the same quantized activations."""
    qa, fields = int8_quantize.quantize(x, levels)
    m, k = x.shape
    kb = k // BLOCK
    out = offsets.double() * fields[..., levels].double().unsqueeze(1)
    for level in range(levels):
        q = qa[:, level * k : (level + 1) * k].long().view(m, 1, kb, BLOCK)
        integer = (q * codes.long().view(1, -1, kb, BLOCK)).sum(-1).double()
        out = out + integer * scales.double() * fields[..., level].double().unsqueeze(1)
    return out.sum(-1)


@needs_int8dot
@pytest.mark.parametrize("levels", int8_quantize.LEVELS)
@pytest.mark.parametrize(("n", "k", "m"), [(16, 32, 1), (40, 64, 5), (200, 96, 37), (960, 576, 7)])
def test_the_product_is_the_exact_block_sums_scaled_in_fp32(n: int, k: int, m: int, levels: int) -> None:
    codes, scales, offsets = _weight(n, k, seed=n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    out = int8_dot.gemm(x, int8_dot.pack(codes, scales, offsets), levels)
    assert out.shape == (m, n) and out.dtype == torch.float32
    exact = _exact(x, codes, scales, offsets, levels)
    # fp32 rounding of K / 32 block terms, each well within 1e-6 of the output's scale.
    assert (out.double() - exact).abs().max() <= 1e-6 * exact.abs().max() * (k // BLOCK), (out, exact)
    # And close to the unquantized product: the activations' int8 levels are the only loss,
    # about 0.5% for one level and well under bf16's rounding (about 0.2%) for two.
    dense = (codes.float().view(n, -1, BLOCK) * scales.unsqueeze(-1) + offsets.unsqueeze(-1)).view(n, k)
    full = x.double() @ dense.double().t()
    assert (out.double() - full).norm() <= (0.01 if levels == 1 else 1e-4) * full.norm()


@needs_int8dot
@pytest.mark.parametrize("levels", int8_quantize.LEVELS)
def test_the_int16_sums_hold_at_their_largest(levels: int) -> None:
    """Every code 15 and every activation +-127: each int16 lane sums 8 pairs of 15 x 127,
    30,480, the most it is ever given; the product is still exact."""
    codes = torch.full((16, 64), 15, dtype=torch.uint8)
    scales, offsets = torch.ones(16, 2), torch.zeros(16, 2)
    x = torch.ones(3, 64)
    x[1] = -1.0
    x[2, ::2] = -1.0
    out = int8_dot.gemm(x, int8_dot.pack(codes, scales, offsets), levels)
    assert torch.equal(out, (x.sum(1, keepdim=True) * 15).expand(3, 16))


@needs_int8dot
def test_nan_and_inf_propagate_and_tiny_blocks_quantize_to_zero() -> None:
    x = torch.ones(4, 64)
    x[0, 3] = float("nan")
    x[1, 40] = float("inf")
    x[2, :32] = 1e-38  # 127 / 1e-38 overflows fp32
    qa, fields = int8_quantize.quantize(x, 2)
    assert fields[0, 0, 0].isnan() and not fields[0, 1, :].isnan().any()
    assert fields[1, 1, 0].isnan() and not fields[1, 0, :].isnan().any()
    assert not qa[2, :32].any() and fields[2, 0, 0] == 0 and fields[2, 0, 2] == 0
    codes, scales, offsets = _weight(16, 64, seed=6)
    out = int8_dot.gemm(x, int8_dot.pack(codes, scales, offsets), 2)
    assert out[:2].isnan().all() and out[2:].isfinite().all()


def test_the_kernel_is_never_compiled_for_a_target_without_avx2(monkeypatch: pytest.MonkeyPatch) -> None:
    """LLVM aborts the process on an intrinsic its target lacks: a numba told to compile
    for another CPU must be refused before anything compiles."""
    from numba.core import config

    for name, features, refused in (
        ("generic", None, True),
        ("haswell", None, False),
        ("haswell", "+avx,+avx2,+fma", False),
        ("haswell", "+avx,-avx2", True),
        (None, "+sse4.2,+avx", True),
        (None, "+avx2,-avx", True),
    ):
        monkeypatch.setattr(config, "CPU_NAME", name)
        monkeypatch.setattr(config, "CPU_FEATURES", features)
        int8_dot._avx2_target_refusal.cache_clear()
        assert (int8_dot._avx2_target_refusal() is not None) == (refused or "avx2" not in FLAGS), (name, features)
    int8_dot._avx2_target_refusal.cache_clear()


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
        int8_dot.gemm(torch.randn(2, 64).bfloat16(), packed, 2)
    with pytest.raises(ValueError, match="levels"):
        int8_dot.gemm(torch.randn(2, 64), packed, 3)


@needs_int8dot
@pytest.mark.parametrize("levels", int8_quantize.LEVELS)
def test_a_row_has_its_bits_alone_at_any_batch(levels: int) -> None:
    codes, scales, offsets = _weight(200, 96, seed=4)
    weight = int8_dot.pack(codes, scales, offsets)
    x = torch.randn(300, 96, generator=torch.Generator().manual_seed(5))
    alone = torch.cat([int8_dot.gemm(x[i : i + 1], weight, levels) for i in range(300)])
    for start, m in ((0, 300), (3, 7), (11, 13), (1, 6), (5, 29), (40, 4), (2, 3)):
        got = int8_dot.gemm(x[start : start + m], weight, levels)
        assert torch.equal(got, alone[start : start + m]), (start, m)


_BITS = (
    "import hashlib, torch\n"
    "from cadence.kernels.cpu import int8_dot\n"
    "gen = torch.Generator().manual_seed(3)\n"
    "codes = torch.randint(0, 16, (960, 576), generator=gen, dtype=torch.uint8)\n"
    "scales = torch.rand(960, 18, generator=gen) / 50\n"
    "weight = int8_dot.pack(codes, scales, -8 * scales)\n"
    "x = torch.randn(37, 576, generator=gen)\n"
    # numpy's hash of the bytes: torch's own parallel ops would hang in a forked child.
    "gemms = lambda: b''.join(int8_dot.gemm(x, weight, levels).numpy().tobytes() for levels in (1, 2))\n"
    "bits = lambda: hashlib.sha256(gemms()).hexdigest()\n"
)


@needs_int8dot
def test_bits_do_not_depend_on_the_thread_count() -> None:
    assert bits_at_threads(_BITS, 1) == bits_at_threads(_BITS, 2)


@needs_int8dot
def test_a_process_forked_after_the_kernel_ran_runs_it_serially_with_the_same_bits() -> None:
    assert bits_after_fork(_BITS) == "0 True"


@needs_int8dot
@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("kernel", [INT8X2DOT, INT8DOT])
def test_an_int4_layer_on_an_integer_kernel_reads_its_own_codes(group_size: int, kernel: str) -> None:
    """The held copy comes from the CPU layout's codes, scales and zero terms: the values
    the dense chunks hold."""
    gen = torch.Generator().manual_seed(group_size)
    linear = torch.nn.Linear(256, 128, bias=True)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(128, 256, generator=gen) / 16)
    layer = Int4Linear.from_linear(linear, group_size=group_size, symmetric=False)
    method = layer.method
    assert isinstance(method, Int4Method)
    assert kernel in method.cpu_kernels(layer)
    x = torch.randn(11, 256, generator=gen)
    out = method.run_cpu_kernel(layer, x, kernel)
    dense = method.dense_chunk_maker(layer, torch.float32)(0, 128)
    full = x.double() @ dense.double().t()
    assert (out.double() - full).norm() <= (0.01 if kernel == INT8DOT else 1e-4) * full.norm()
    # One-hot rows read the held values back: a lone 1.0 quantizes to 127 at scale 1/127.
    held = method.run_cpu_kernel(layer, torch.eye(256), kernel)
    assert torch.allclose(held, dense.t(), rtol=1e-6, atol=1e-6 * float(dense.abs().max()))
    assert list(layer.cpu_int_dot) == [kernel]


@needs_int8dot
@pytest.mark.parametrize("kernel", [INT8X2DOT, INT8DOT])
def test_only_a_user_who_names_an_integer_kernel_gets_it(
    tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """auto neither offers the integer kernels (nor asks the hardware, which compiles them)
    nor runs them; --cpu-kernels KERNEL runs it on every int4 projection."""
    with monkeypatch.context() as patch:
        patch.setattr(int8_dot, "hardware_ready", lambda: pytest.fail("auto compiled an integer kernel"))
        model = load_llama(tiny_model_dir("llama"), torch.float32, "cpu", "int4", cpu_kernels="auto")
    kernels = [m.cpu_kernel for m in model.modules() if isinstance(m, LinearLayer) and m.cpu_kernel is not None]
    assert kernels and not {INT8X2DOT, INT8DOT} & set(kernels)
    model = load_llama(tiny_model_dir("llama"), torch.float32, "cpu", "int4", cpu_kernels=kernel)
    layers = [m for m in model.modules() if isinstance(m, LinearLayer) and m.cpu_kernel is not None]
    assert len(layers) == 4 * len(model.model.layers)
    assert all(m.cpu_kernel == kernel and list(m.cpu_int_dot) == [kernel] for m in layers)
