"""The CPU kernel planner: plans per batch size, choices from measured times, the on-disk
table, the memory budget for dense copies, and the option's validation."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from cadence.engine.engine_args import EngineArgs
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.quantization import cpu_kernel_table, cpu_planner
from cadence.engine.quantization.cpu_kernels import BUCKETS, KernelPlan
from cadence.engine.quantization.cpu_planner import choose, group_summary, plan_cpu_kernels, validate_cpu_kernels
from cadence.engine.quantization.linear import Int8Linear
from cadence.engine.quantization.lm_head import Int8HeadMethod
from cadence.engine.quantization.method import LinearLayer
from cadence.kernels.half_linear import BF16, BF16DOT, FP16, available
from cadence.kernels.quant_formats import quantize_int8
from cadence.server.cli import build_parser, engine_args_from
from helpers import load_llama


@pytest.fixture(autouse=True)
def own_kernel_table(tmp_path, monkeypatch) -> None:
    """Each test here its own empty timing table: several fake the planner's timings, and
    a faked table entry must reach no other test (nor may one another test measured)."""
    monkeypatch.setattr(cpu_planner, "default_table_path", lambda: str(tmp_path / "own-cpu-kernels.json"))


def test_a_plan_serves_each_batch_size_from_its_nearest_bucket() -> None:
    plan = KernelPlan(("packed", "packed", "dense", "dense", "dequant"))
    assert [plan.kernel_for(m) for m in (1, 2, 3, 8, 9, 32, 33, 128, 129, 4096)] == [
        "packed", "packed", "packed", "packed", "dense", "dense", "dense", "dense", "dequant", "dequant",
    ]  # fmt: skip
    assert not plan.batch_invariant  # packed rounds activations to bf16, the dense family does not
    assert KernelPlan(("dense",) * 4 + ("dequant",)).batch_invariant  # the same bits
    assert not KernelPlan(("fp16",) * 4 + ("dense",)).batch_invariant  # fp16 weights: bits of their own
    with pytest.raises(ValueError):
        KernelPlan(("packed",))
    with pytest.raises(ValueError):
        KernelPlan.fixed("fast")


TIMES = {  # µs at M = 1, 4, 16, 64, 256: packed wins small batches, the dense family large ones
    "packed": [10.0, 20.0, 80.0, 300.0, 1200.0],
    "dequant": [60.0, 62.0, 90.0, 150.0, 500.0],
    "dense": [30.0, 32.0, 40.0, 100.0, 400.0],
    "fp16": [12.0, 18.0, 30.0, 90.0, 380.0],
}
WITHOUT_FP16 = {k: v for k, v in TIMES.items() if k != "fp16"}
# The half kernels this build and CPU run: fp16 needs fbgemm, bf16 native bf16.
HALF = [fmt.name for fmt in (FP16, BF16, BF16DOT) if available(fmt)]
# The kernels a quantized layer offers with fp32 activations here.
BUILD_KERNELS = sorted(["dense", "dequant", "packed", *HALF])


def test_choose_keeps_one_family_under_auto_and_mixes_under_fastest() -> None:
    assert choose(WITHOUT_FP16, "auto", {"dense"}) == KernelPlan.fixed("dense")
    # Without the copy the dense family is dequant, which here loses to packed on average.
    assert choose(WITHOUT_FP16, "auto", set()) == KernelPlan.fixed("packed")
    assert choose(WITHOUT_FP16, "fastest", {"dense"}).kernels == ("packed", "packed", "dense", "dense", "dense")
    assert choose(WITHOUT_FP16, "fastest", set()).kernels == ("packed", "packed", "packed", "dequant", "dequant")
    assert choose(WITHOUT_FP16, "dequant", {"dense"}) == KernelPlan.fixed("dequant")
    # fp16, near the best at every M, wins auto where its copy fits, and only then.
    assert choose(TIMES, "auto", {"dense", "fp16"}) == KernelPlan.fixed("fp16")
    assert choose(TIMES, "auto", {"dense"}) == KernelPlan.fixed("dense")
    assert choose(TIMES, "fastest", {"dense", "fp16"}).kernels == ("packed", "fp16", "fp16", "fp16", "fp16")


def test_throughput_ranks_on_batched_steps_only() -> None:
    # packed wins batch 1 and 4 by far and loses from 16 up: auto keeps it (each batch
    # size counts alike), throughput takes the kernel that wins batched steps. Each is
    # one family, so both stay batch invariant.
    assert choose(WITHOUT_FP16, "auto", set()) == KernelPlan.fixed("packed")
    assert choose(WITHOUT_FP16, "throughput", set()) == KernelPlan.fixed("dequant")
    assert choose(TIMES, "throughput", {"dense"}) == KernelPlan.fixed("dense")


def test_a_format_kernel_serves_generated_tokens_only_where_it_costs_no_batched_speed() -> None:
    """A kernel of the weight format's own coarser arithmetic (int8dot for GGUF's 4-bit
    blocks) is one more choice for auto, but where it wins small batches and loses batched
    steps, the finer kernel keeps the generated tokens' rows, though the mean favours it."""
    everywhere = {**TIMES, "int8dot": [t * 0.7 for t in TIMES["fp16"]]}
    kept = {"dense", "fp16", "int8dot"}
    assert choose(everywhere, "auto", kept, format_kernels=("int8dot",)) == KernelPlan.fixed("int8dot")
    small_only = {**TIMES, "int8dot": [4.0, 6.0, 31.0, 95.0, 400.0]}
    assert choose(small_only, "auto", kept) == KernelPlan.fixed("int8dot")  # a kernel like any other: the mean
    assert choose(small_only, "auto", kept, format_kernels=("int8dot",)) == KernelPlan.fixed("fp16")
    # Weighed on the finer kernels' own scale: where it is rejected, auto plans what precise
    # (which never times it) plans, not a choice its batch-1 times tilted towards packed.
    skewed = {"packed": [10.0, 14.0, 40.0, 120.0, 480.0], "fp16": [16.0, 14.0, 30.0, 90.0, 380.0]}
    with_int8 = {**skewed, "int8dot": [2.0, 6.0, 31.0, 95.0, 400.0]}
    precise = choose(skewed, "auto", {"fp16"})
    assert precise == KernelPlan.fixed("fp16")
    assert choose(with_int8, "auto", {"fp16", "int8dot"}, format_kernels=("int8dot",)) == precise
    # Prompt rows rank on prefill sizes alone: there it wins, or it does not.
    prefill = {**TIMES, "int8dot": [40.0, 50.0, 60.0, 70.0, 300.0]}
    assert choose(prefill, "auto", kept, token_rows=True, format_kernels=("int8dot",)) == KernelPlan.fixed(
        "fp16"
    ).with_prompt("int8dot")


def test_auto_weighs_a_group_by_its_share_of_the_whole_model() -> None:
    times = {"packed": [10.0, 10.0, 40.0, 100.0, 400.0], "fp16": [25.0, 12.0, 30.0, 60.0, 250.0]}
    # On its own, packed's lead at M=1 outweighs fp16's at large M...
    assert choose(times, "auto", {"fp16"}) == KernelPlan.fixed("packed")
    # ...but where the rest of the model (an LM head, say) dominates the step at M=1, the
    # group's 15 µs there count for little, and its 150 µs at M=256 for more.
    assert choose(times, "auto", {"fp16"}, model_best=[1000.0, 100.0, 300.0, 600.0, 2500.0]) == KernelPlan.fixed("fp16")


def test_options_are_validated(tmp_path) -> None:
    for mode in (*cpu_planner.CPU_KERNEL_MODES, str(tmp_path / "table.json")):
        assert validate_cpu_kernels(mode) == mode
    for bad in ("fast", str(tmp_path / "table.txt"), str(tmp_path / "missing" / "table.json")):
        with pytest.raises(ValueError, match="cpu_kernels"):
            EngineArgs(model="m", cpu_kernels=bad)
    args = build_parser().parse_args(["serve", "--cpu-kernels", "fastest"])
    assert engine_args_from(args).cpu_kernels == "fastest"
    assert engine_args_from(build_parser().parse_args(["serve"])).cpu_kernels == "auto"


def test_a_capped_instruction_set_gets_its_own_times(monkeypatch) -> None:
    """Times measured under ATEN_CPU_CAPABILITY=avx2 (or any library's cap) must not be read
    by an uncapped engine on the same CPU, nor the other way round."""
    uncapped = cpu_kernel_table.machine_key()
    for name in cpu_kernel_table.ISA_CAPS:
        monkeypatch.setenv(name, "avx2")
        assert cpu_kernel_table.machine_key() != uncapped, name
        monkeypatch.delenv(name)
    assert cpu_kernel_table.machine_key() == uncapped


def _int8_model(tiny_model_dir, mode: str) -> LlamaForCausalLM:
    return load_llama(tiny_model_dir("llama"), torch.float32, "cpu", "int8", cpu_kernels=mode)


def test_auto_measures_once_and_reads_the_table_after(tiny_model_dir, tmp_path, monkeypatch, caplog) -> None:
    table = tmp_path / "kernels.json"
    calls: list[tuple[str, int]] = []
    real = cpu_planner.time_cell

    def counting(group: cpu_planner.LayerGroup, kernel: str, m: int, dtype: torch.dtype) -> float:
        calls.append((kernel, m))
        return real(group, kernel, m, dtype)

    monkeypatch.setattr(cpu_planner, "time_cell", counting)
    monkeypatch.setattr(cpu_planner, "MIN_CORE_SHARE", 0.0)  # saved however busy the test machine is
    with caplog.at_level(logging.INFO, logger="cadence.engine.quantization.cpu_planner"):
        model = _int8_model(tiny_model_dir, str(table))
    saved = json.loads(table.read_text())
    entries = saved[cpu_kernel_table.machine_key()]
    # Each format-and-shape group was timed with every kernel at every bucket, once.
    assert len(calls) == len(entries) * len(BUILD_KERNELS) * len(BUCKETS)
    assert all(sorted(times) == BUILD_KERNELS for times in entries.values())
    assert all(len(t) == len(BUCKETS) for times in entries.values() for t in times.values())
    summary = group_summary(model.modules())
    assert sum(summary.values()) == 4 * len(model.model.layers)  # the four projections of every layer
    plans = [m.cpu_plan for m in model.modules() if isinstance(m, LinearLayer) and m.cpu_plan is not None]
    assert all(len(set(plan.kernels)) == 1 for plan in plans)  # auto: one kernel for generated rows at every M
    assert "CPU kernels for int8" in caplog.text and "batch-invariant" in caplog.text
    calls.clear()
    again = _int8_model(tiny_model_dir, str(table))
    assert calls == []  # the table answered
    assert group_summary(again.modules()) == summary


def test_times_measured_on_a_busy_machine_are_not_saved(tiny_model_dir, tmp_path, monkeypatch, caplog) -> None:
    table = tmp_path / "kernels.json"
    monkeypatch.setattr(cpu_planner, "MIN_CORE_SHARE", 1e9)  # no share of the cores is enough
    with caplog.at_level(logging.WARNING, logger="cadence.engine.quantization.cpu_planner"):
        model = _int8_model(tiny_model_dir, str(table))
    assert not table.exists() and "not saved" in caplog.text
    assert sum(group_summary(model.modules()).values()) == 4 * len(model.model.layers)  # still planned


def test_dense_copies_stay_within_the_memory_budget(tiny_model_dir, tmp_path, monkeypatch) -> None:
    table = str(tmp_path / "kernels.json")
    # The dense family always wins: only memory decides whether its copy is kept.
    times = {"packed": 9.0, "fp16": 5.0, "bf16": 5.0}
    monkeypatch.setattr(cpu_planner, "time_cell", lambda group, kernel, m, dtype: times.get(kernel, 1.0))
    monkeypatch.setattr(cpu_planner, "available_host_memory", lambda: 1 << 40)
    held = _int8_model(tiny_model_dir, table)
    layers = [m for m in held.modules() if getattr(m, "cpu_plan", None) is not None]
    assert layers and all(m.cpu_plan == KernelPlan.fixed("dense") and m.cpu_dense is not None for m in layers)
    monkeypatch.setattr(cpu_planner, "available_host_memory", lambda: 1024)
    tight = _int8_model(tiny_model_dir, table)
    layers = [m for m in tight.modules() if getattr(m, "cpu_plan", None) is not None]
    assert layers and all(m.cpu_plan == KernelPlan.fixed("dequant") and m.cpu_dense is None for m in layers)
    # A fixed choice is the user's: dense is kept whatever the budget, and nothing is timed.
    monkeypatch.setattr(cpu_planner, "time_cell", lambda *a: pytest.fail("a fixed choice measures nothing"))
    forced = _int8_model(tiny_model_dir, "dense")
    assert all(m.cpu_dense is not None for m in forced.modules() if getattr(m, "cpu_plan", None) is not None)
    for half in HALF:
        forced = _int8_model(tiny_model_dir, half)
        held_half = [m for m in forced.modules() if isinstance(m, LinearLayer) and m.cpu_plan is not None]
        assert held_half and all(list(m.cpu_half) == [half] and m.cpu_dense is None for m in held_half)


def test_fastest_keeps_both_copies_only_where_both_fit(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """A mixed plan reading dense and fp16 copies must fit both in the budget."""
    if not available(FP16):
        pytest.skip("this torch build has no fbgemm")
    times = {"packed": [9.0] * 5, "dequant": [9.0] * 5, "dense": [5.0] * 4 + [1.0], "fp16": [1.0] * 4 + [5.0]}
    times["bf16"] = times["bf16dot"] = [9.0] * 5
    monkeypatch.setattr(cpu_planner, "time_cell", lambda group, kernel, m, dtype: times[kernel][BUCKETS.index(m)])
    monkeypatch.setattr(cpu_planner, "available_host_memory", lambda: 1 << 40)

    def planned(model: LlamaForCausalLM) -> list[LinearLayer]:
        return [m for m in model.modules() if isinstance(m, LinearLayer) and m.cpu_plan is not None]

    roomy = planned(_int8_model(tiny_model_dir, "fastest"))
    assert roomy and all(m.cpu_plan == KernelPlan(("fp16",) * 4 + ("dense",)) for m in roomy)
    assert all(m.cpu_dense is not None and "fp16" in m.cpu_half for m in roomy)
    # Room for either copy of the largest group but not both: no layer keeps two.
    groups = cpu_planner.layer_groups(roomy, torch.float32)
    both = max(g.held_bytes("dense", torch.float32) + g.held_bytes("fp16", torch.float32) for g in groups)
    memory = int(both * 0.9 / cpu_planner.DENSE_MEMORY_FRACTION)
    monkeypatch.setattr(cpu_planner, "available_host_memory", lambda: memory)
    tight = planned(_int8_model(tiny_model_dir, "fastest"))
    kept = 0
    for group in cpu_planner.layer_groups(tight, torch.float32):
        layer = group.layers[0]
        kept += group.held_bytes("dense", torch.float32) if layer.cpu_dense is not None else 0
        kept += group.held_bytes("fp16", torch.float32) if "fp16" in layer.cpu_half else 0
    assert 0 < kept <= memory * cpu_planner.DENSE_MEMORY_FRACTION
    assert any(m.cpu_dense is None or "fp16" not in m.cpu_half for m in tight)


def test_a_copy_the_weights_refuse_leaves_no_other_copy_behind(monkeypatch, caplog) -> None:
    """Under ``fastest``, fp16's copy is refused (a value beyond its range) after the
    dense copy was made for the same plan: the plan is chosen again, and the layer keeps
    exactly the copies the new plan reads."""
    if not available(FP16):
        pytest.skip("this torch build has no fbgemm")
    weight = torch.randn(64, 96)
    weight[3, 5] = 1e5
    layer = Int8Linear(*quantize_int8(weight))
    times = {"packed": [9.0] * 5, "dequant": [9.0] * 5, "dense": [5.0] * 4 + [1.0], "fp16": [1.0] * 4 + [5.0]}
    times["bf16"] = [2.0] * 5
    times["bf16dot"] = [3.0] * 5
    monkeypatch.setattr(cpu_planner, "time_cell", lambda group, kernel, m, dtype: times[kernel][BUCKETS.index(m)])
    monkeypatch.setattr(cpu_planner, "available_host_memory", lambda: 1 << 40)
    with caplog.at_level(logging.INFO, logger="cadence.engine.quantization.cpu_planner"):
        plan_cpu_kernels([layer], torch.float32, "fastest")
    assert "no fp16" in caplog.text
    assert layer.cpu_plan is not None and "fp16" not in layer.cpu_plan.kernels
    held = {*layer.cpu_half, *(["dense"] if layer.cpu_dense is not None else [])}
    assert held == set(layer.cpu_plan.kernels) & {"dense", "fp16", "bf16", "bf16dot"}
    expected = ("bf16",) * 4 + ("dense",) if "bf16" in HALF else ("dense",) * 5
    assert layer.cpu_plan.kernels == expected


def test_every_kernel_gives_the_layer_its_values() -> None:
    torch.manual_seed(0)
    weight = torch.randn(64, 96) / 10
    layer = Int8Linear(*quantize_int8(weight))
    plan_cpu_kernels([layer], torch.float32, "dense")
    x = torch.randn(5, 96)
    exact = x @ layer.dequantized_weight(torch.float32).t()
    outputs = {}
    for kernel in ("packed", "dequant", "dense", *HALF):
        layer.cpu_plan = KernelPlan.fixed(kernel)
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


def test_a_malformed_or_stale_table_is_measured_again(tiny_model_dir, tmp_path, monkeypatch) -> None:
    table = tmp_path / "kernels.json"
    monkeypatch.setattr(cpu_planner, "MIN_CORE_SHARE", 0.0)
    table.write_text("[1, 2, 3]")  # JSON, but not a table
    model = _int8_model(tiny_model_dir, str(table))
    assert sum(group_summary(model.modules()).values()) == 4 * len(model.model.layers)
    saved = json.loads(table.read_text())
    group = next(iter(saved[cpu_kernel_table.machine_key()]))
    # Lists of the wrong length, and a name that is no kernel, are dropped and timed again.
    saved[cpu_kernel_table.machine_key()][group] = {"packed": [1.0, 2.0], "fast": [1.0] * len(BUCKETS)}
    table.write_text(json.dumps(saved))
    calls: list[str] = []
    real = cpu_planner.time_cell

    def counting(group: cpu_planner.LayerGroup, kernel: str, m: int, dtype: torch.dtype) -> float:
        calls.append(kernel)
        return real(group, kernel, m, dtype)

    monkeypatch.setattr(cpu_planner, "time_cell", counting)
    _int8_model(tiny_model_dir, str(table))
    assert sorted(set(calls)) == BUILD_KERNELS and len(calls) == len(BUILD_KERNELS) * len(BUCKETS)
    assert sorted(json.loads(table.read_text())[cpu_kernel_table.machine_key()][group]) == BUILD_KERNELS


def test_a_mode_offering_fewer_kernels_keeps_the_others_times(tmp_path) -> None:
    """precise reads a group's times without int8dot's; what it measures and saves must not
    drop the int8dot times auto measured, or the next auto start would time them again."""
    path = str(tmp_path / "kernels.json")
    table = cpu_kernel_table.KernelTable(path)
    table.record("group", "int8dot", [1.0] * len(BUCKETS))
    table.save()
    again = cpu_kernel_table.KernelTable(path)
    assert again.times("group", ("packed", "fp16")) == {}
    again.record("group", "fp16", [2.0] * len(BUCKETS))
    again.save()
    stored = cpu_kernel_table.KernelTable(path).times("group", ("fp16", "int8dot"))
    assert stored == {"fp16": [2.0] * len(BUCKETS), "int8dot": [1.0] * len(BUCKETS)}


@pytest.mark.parametrize("rounding", ["packed", *[k for k in ("bf16", "bf16dot") if k in HALF]])
def test_the_int8_head_never_rounds_logits_to_bf16(tiny_model_dir, tmp_path, monkeypatch, rounding: str) -> None:
    """``packed`` and ``bf16`` give bf16 logits, which would tie greedy candidates, and
    ``bf16dot`` rounds the final hidden state to bf16: none serves the head, however fast,
    and a table naming one for it is ignored."""
    monkeypatch.setattr(cpu_planner, "time_cell", lambda g, k, m, d: 1.0 if k == rounding else 50.0)
    for mode in ("auto", "fastest", rounding, str(tmp_path / "kernels.json")):
        model = load_llama(tiny_model_dir("tied"), torch.float32, "cpu", "int8", True, cpu_kernels=mode)
        layers = [m for m in model.modules() if isinstance(m, LinearLayer)]
        heads = [m.cpu_plan for m in layers if isinstance(m.method, Int8HeadMethod)]
        assert len(heads) == 1 and heads[0] is not None, mode
        assert not {"packed", "bf16", "bf16dot"} & set(heads[0].kernels), mode
        body = [m.cpu_plan for m in layers if not isinstance(m.method, Int8HeadMethod)]
        assert body and all(plan == KernelPlan.fixed(rounding) for plan in body), mode


def test_a_table_path_with_a_tilde_is_expanded(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    assert validate_cpu_kernels("~/kernels.json") == str(tmp_path / "kernels.json")


def test_a_named_kernel_a_group_cannot_run_leaves_that_group_to_auto(tiny_model_dir, tmp_path, monkeypatch) -> None:
    """--cpu-kernels packed: the int8 LM head has no packed kernel, so it gets what auto
    would choose from its own (timed) kernels, not merely its first one."""
    times = {"packed": 1.0, "dequant": 40.0, "dense": 30.0, "fp16": 5.0, "bf16": 50.0, "bf16dot": 50.0}
    monkeypatch.setattr(cpu_planner, "time_cell", lambda group, kernel, m, dtype: times[kernel])
    monkeypatch.setattr(cpu_planner, "default_table_path", lambda: str(tmp_path / "kernels.json"))
    model = load_llama(tiny_model_dir("tied"), torch.float32, "cpu", "int8", True, cpu_kernels="packed")
    layers = [m for m in model.modules() if isinstance(m, LinearLayer) and m.cpu_plan is not None]
    heads = [m.cpu_plan for m in layers if isinstance(m.method, Int8HeadMethod)]
    expected = "fp16" if "fp16" in HALF else "dense"
    assert heads == [KernelPlan.fixed(expected)]
    assert all(m.cpu_plan == KernelPlan.fixed("packed") for m in layers if not isinstance(m.method, Int8HeadMethod))
