"""The CPU kernel planner: each quantized layer's kernel by rule (format, --cpu-kernels,
instruction set, the machine's memory), never by a timing; the copies within the memory
budget; the option's validation."""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import time
from collections.abc import Callable

import pytest
import torch

from cadence.engine.engine_args import EngineArgs
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.quantization import cpu_planner
from cadence.engine.quantization.cpu_planner import group_summary, plan_cpu_kernels
from cadence.engine.quantization.linear import Int8Linear
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.engine.quantization.lm_head import Int8HeadMethod
from cadence.kernels.cpu.half_linear import BF16, BF16DOT, FP16, available
from cadence.kernels.cpu.kernel_names import CPU_KERNEL_MODES, validate_cpu_kernels
from cadence.kernels.formats.quant_formats import quantize_int8
from cadence.server.cli import build_parser, engine_args_from
from tests.support.helpers import load_llama

# The half kernels this build and CPU run: fp16 needs fbgemm, bf16 and bf16dot native bf16.
HALF = [fmt.name for fmt in (FP16, BF16, BF16DOT) if available(fmt)]
# What auto runs here for a layer that may keep a copy, by the rule.
AUTO_HERE = "bf16dot" if "bf16dot" in HALF else "fp16" if "fp16" in HALF else "dense"


def _int8_model(
    tiny_model_dir: Callable[[str], str], mode: str, quantize_lm_head: bool | None = None
) -> LlamaForCausalLM:
    return load_llama(tiny_model_dir("tied"), torch.float32, "cpu", "int8", quantize_lm_head, cpu_kernels=mode)


def _planned(model: torch.nn.Module) -> list[LinearLayer]:
    """The model's layers given a CPU kernel."""
    return [m for m in model.modules() if isinstance(m, LinearLayer) and m.cpu_kernel is not None]


def _kernels(model: torch.nn.Module) -> tuple[list[str | None], list[str | None]]:
    """(the head's kernels, the other quantized layers')."""
    layers = _planned(model)
    heads = [m.cpu_kernel for m in layers if isinstance(m.method, Int8HeadMethod)]
    return heads, [m.cpu_kernel for m in layers if not isinstance(m.method, Int8HeadMethod)]


def test_options_are_validated() -> None:
    for mode in CPU_KERNEL_MODES:
        assert validate_cpu_kernels(mode) == mode
    # The modes that chose by timing are gone, and a timing table is no option any more.
    for bad in ("fast", "fastest", "throughput", "precise", "/tmp/table.json"):
        with pytest.raises(ValueError, match="cpu_kernels"):
            EngineArgs(model="m", cpu_kernels=bad)
    args = build_parser().parse_args(["serve", "--cpu-kernels", "fp16"])
    assert engine_args_from(args).cpu_kernels == "fp16"
    assert engine_args_from(build_parser().parse_args(["serve"])).cpu_kernels == "auto"


def test_auto_runs_the_finest_kernel_this_cpu_makes_fast(
    tiny_model_dir: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="cadence.engine.quantization.cpu_planner"):
        model = _int8_model(tiny_model_dir, "auto", quantize_lm_head=True)
    heads, body = _kernels(model)
    assert len(body) == 4 * len(model.model.layers) and set(body) == {AUTO_HERE}
    # The head by the same rule (bf16dot on its exact codes, fp32 logits).
    assert heads == [AUTO_HERE]
    assert "CPU kernel for int8" in caplog.text and AUTO_HERE in caplog.text


@pytest.mark.parametrize(
    "missing,expected",
    [((), "bf16dot"), (("bf16dot",), "fp16"), (("bf16dot", "fp16"), "dense"), (("fp16",), "bf16dot")],
)
def test_auto_follows_the_instruction_set(
    tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch, missing: tuple[str, ...], expected: str
) -> None:
    """The rule by what the CPU (and the torch build) runs, each case faked on this machine:
    AVX512-BF16 gives bf16dot; without it fbgemm's fp16; without that the kept fp32 copy."""
    if expected != "dense" and expected not in HALF:
        pytest.skip(f"this CPU does not run {expected}")
    real = cpu_planner.available
    monkeypatch.setattr(cpu_planner, "available", lambda fmt: fmt.name not in missing and real(fmt))
    heads, body = _kernels(_int8_model(tiny_model_dir, "auto", quantize_lm_head=True))
    assert set(body) == set(heads) == {expected}


def test_the_kernels_never_follow_a_timing(
    tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """However the clocks read while it plans (adversarial: jumping back and forth by
    seconds), and however busy both cores are, the plan is the rule's."""
    quiet = _kernels(_int8_model(tiny_model_dir, "auto", quantize_lm_head=True))
    rng = random.Random(0)
    for name in ("perf_counter", "process_time", "monotonic", "time"):
        monkeypatch.setattr(time, name, lambda: rng.uniform(0.0, 1e4))
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL) for _ in range(2)]
    try:
        busy = _kernels(_int8_model(tiny_model_dir, "auto", quantize_lm_head=True))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    assert busy == quiet


def test_copies_stay_within_the_machines_memory(
    tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept copy runs only while every copy fits a share of the machine's total memory
    (what is free at the moment plays no part); with none, the kernels that keep none."""
    monkeypatch.setattr(cpu_planner, "total_host_memory", lambda: 1 << 40)
    roomy = _int8_model(tiny_model_dir, "auto", quantize_lm_head=True)
    assert _kernels(roomy)[1] and set(_kernels(roomy)[1]) == {AUTO_HERE}
    monkeypatch.setattr(cpu_planner, "total_host_memory", lambda: 1024)
    tight = _int8_model(tiny_model_dir, "auto", quantize_lm_head=True)
    heads, body = _kernels(tight)
    assert set(body) == {"packed"} and heads == ["dequant"]
    planned = _planned(tight)
    assert all(m.cpu_dense is None and not m.cpu_half for m in planned)
    # Room for some groups' copies but not all: the model's first groups keep theirs, and together they fit.
    groups = cpu_planner.layer_groups(planned, torch.float32)
    first = groups[0].held_bytes(AUTO_HERE, torch.float32)
    memory = int(first * 1.5 / cpu_planner.DENSE_MEMORY_FRACTION)
    monkeypatch.setattr(cpu_planner, "total_host_memory", lambda: memory)
    some = _planned(_int8_model(tiny_model_dir, "auto"))
    groups = cpu_planner.layer_groups(some, torch.float32)
    kept = sum(g.held_bytes(g.layers[0].cpu_kernel or "", torch.float32) for g in groups)
    assert 0 < kept <= memory * cpu_planner.DENSE_MEMORY_FRACTION
    # A named kernel is the user's: its copy is made whatever the budget.
    monkeypatch.setattr(cpu_planner, "total_host_memory", lambda: 1024)
    for kernel in ("dense", *HALF):
        held = [m for m in _planned(_int8_model(tiny_model_dir, kernel)) if m.cpu_kernel == kernel]
        assert held and all(list(m.cpu_half) == ([] if kernel == "dense" else [kernel]) for m in held), kernel
        assert all((m.cpu_dense is not None) == (kernel == "dense") for m in held), kernel


def test_every_kernel_gives_the_layer_its_values() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 96) / 10
    layer = Int8Linear(*quantize_int8(weight))
    plan_cpu_kernels([layer], torch.float32, "dense")
    x = torch.randn(5, 96)
    exact = x @ layer.dequantized_weight(torch.float32).t()
    outputs = {}
    for kernel in ("packed", "dequant", "dense", *HALF):
        layer.cpu_kernel = kernel
        outputs[kernel] = layer(x)
        assert torch.allclose(outputs[kernel], exact, rtol=2e-2, atol=2e-2)
    assert torch.equal(outputs["dense"], outputs["dequant"])
    dense = layer.dequantized_weight(torch.float32)
    if "fp16" in HALF:  # the weight rounded to fp16 once, then fp32 arithmetic
        rounded = x.double() @ dense.half().double().t()
        assert torch.allclose(outputs["fp16"].double(), rounded, rtol=1e-5, atol=1e-5)
    if "bf16" in HALF:  # weight and activations rounded to bf16, summed in fp32, output rounded to bf16
        rounded = x.bfloat16().double() @ dense.bfloat16().double().t()
        assert torch.allclose(outputs["bf16"].double(), rounded, rtol=2**-8, atol=1e-6)
        assert torch.equal(outputs["bf16"], outputs["bf16"].bfloat16().float())
    if "bf16dot" in HALF:  # the same rounding of both, summed in fp32, the output not rounded again
        rounded = x.bfloat16().double() @ dense.bfloat16().double().t()
        assert torch.allclose(outputs["bf16dot"].double(), rounded, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("rounding", ["auto", "packed", *[k for k in ("bf16", "bf16dot") if k in HALF]])
def test_the_int8_head_never_rounds_logits_to_bf16(tiny_model_dir: Callable[[str], str], rounding: str) -> None:
    """``packed`` and ``bf16`` give bf16 logits, which would tie greedy candidates: neither
    serves the head, even where --cpu-kernels names it for the model; the head gets auto's
    choice among its own (``bf16dot``, fp32 logits, where it runs)."""
    heads, body = _kernels(_int8_model(tiny_model_dir, rounding, quantize_lm_head=True))
    assert heads == [AUTO_HERE], rounding
    assert body and set(body) == {AUTO_HERE if rounding == "auto" else rounding}, rounding


@pytest.mark.skipif("bf16dot" not in HALF, reason="bf16dot needs AVX512-BF16")
def test_the_int8_head_on_bf16dot_multiplies_its_exact_codes(tiny_model_dir: Callable[[str], str]) -> None:
    """The head's codes go to bf16dot unrounded (int8 fits bf16's mantissa) and its row
    scales multiply the fp32 products: only the hidden state is rounded, to bf16."""
    model = _int8_model(tiny_model_dir, "auto", quantize_lm_head=True)
    head = model.lm_head
    assert head is not None and head.cpu_kernel == "bf16dot"
    hidden = torch.randn(5, head.in_features, generator=torch.Generator().manual_seed(3))
    rounded = hidden.to(torch.bfloat16).double()
    expected = (rounded @ head.qweight.double().T) * head.scale.double()
    logits = head(hidden)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), expected, rtol=1e-6, atol=1e-5)


def test_group_summary_counts_layers_by_kernel(tiny_model_dir: Callable[[str], str]) -> None:
    model = _int8_model(tiny_model_dir, "packed", quantize_lm_head=True)
    summary = group_summary(model.modules())
    assert summary == {"packed": 4 * len(model.model.layers), AUTO_HERE: 1}
