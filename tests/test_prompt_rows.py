"""Prompt tokens' rows on a kernel of their own: which rows they are, how a layer runs them,
and how the planner and the engine set it up (batch invariance itself: test_batch_invariance)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cadence import LLM
from cadence.engine import model_runner
from cadence.engine.attention import cpu_paged_decode
from cadence.engine.quantization import cpu_planner
from cadence.engine.quantization.cpu_kernels import DENSE, DEQUANT, PACKED, KernelPlan
from cadence.engine.quantization.cpu_planner import choose, splits_prompt_rows
from cadence.engine.quantization.linear import Int8Linear, Int8Method
from cadence.engine.quantization.method import LinearLayer
from cadence.engine.quantization.prompt_rows import RowRuns, current, row_runs, step_rows
from helpers import SPLIT_TIMES, fake_split_times, greedy


def test_rows_of_each_sequence_split_where_its_prompt_ends() -> None:
    # A decode (position 5 of a 3-token prompt), a whole 6-token prompt, a recomputed
    # request whose chunk crosses its prompt's end at position 4, and another decode.
    rows = row_runs(context_lens=[5, 0, 3, 9], query_lens=[1, 6, 3, 1], prompt_lens=[3, 6, 4, 2])
    assert rows == RowRuns(11, ((0, 1, False), (1, 8, True), (8, 11, False)))
    assert row_runs([0], [4], [4]).runs == ((0, 4, True),)
    assert row_runs([7, 8], [1, 1], [2, 2]).runs == ((0, 2, False),)
    assert row_runs([], [], []) == RowRuns(0, ())


def test_step_rows_hold_for_the_pass_inside_only() -> None:
    outer, inner = row_runs([0], [2], [2]), row_runs([0], [3], [1])
    assert current() is None
    with step_rows(outer):
        with step_rows(inner):
            assert current() is inner
        assert current() is outer
    assert current() is None


def _int8_layer() -> LinearLayer:
    torch.manual_seed(0)
    layer = Int8Linear.from_linear(nn.Linear(64, 48, bias=False))
    layer.cpu_plan = KernelPlan.fixed(PACKED).with_prompt(DEQUANT)
    return layer


def test_a_split_plan_runs_prompt_rows_on_the_prompt_kernel_and_the_rest_on_the_other() -> None:
    layer = _int8_layer()
    method = layer.method
    assert isinstance(method, Int8Method)
    x = torch.randn(11, 64)
    rows = row_runs([5, 0, 3, 9], [1, 6, 3, 1], [3, 6, 4, 2])
    with step_rows(rows):
        out = layer(x)
    packed = [method.run_cpu_kernel(layer, x[a:b], PACKED) for a, b in ((0, 1), (8, 11))]
    prompt = method.run_cpu_kernel(layer, x[1:8], DEQUANT)
    assert torch.equal(out, torch.cat([packed[0], prompt, packed[1]]))
    # The two kernels give other bits (packed rounds activations to bf16), so the split shows.
    assert not torch.equal(prompt, method.run_cpu_kernel(layer, x[1:8], PACKED))
    # Without stated rows (a warm-up), and on a layer that does not take the step's rows
    # (an LM head, an expert), every row runs the generated tokens' kernel.
    assert torch.equal(layer(x), method.run_cpu_kernel(layer, x, PACKED))
    layer.token_rows = False
    with step_rows(rows):
        assert torch.equal(layer(x), method.run_cpu_kernel(layer, x, PACKED))


def test_rows_that_are_not_the_steps_are_refused() -> None:
    layer = _int8_layer()
    with step_rows(row_runs([0], [5], [5])), pytest.raises(RuntimeError, match="5 tokens"):
        layer(torch.randn(4, 64))


def test_auto_splits_only_layers_that_take_the_steps_rows() -> None:
    split = KernelPlan.fixed(PACKED).with_prompt(DEQUANT)
    assert choose(SPLIT_TIMES, "auto", set(), token_rows=True) == split
    assert choose(SPLIT_TIMES, "auto", set()) == KernelPlan.fixed(PACKED)
    assert choose(SPLIT_TIMES, "auto", {DENSE}, token_rows=True) == KernelPlan.fixed(PACKED).with_prompt(DENSE)
    assert choose(SPLIT_TIMES, "throughput", set(), token_rows=True).prompt is None
    assert split.batch_invariant and split.all_kernels == {PACKED, DEQUANT}
    assert split.describe() == "packed; prompt tokens dequant"
    with pytest.raises(ValueError):
        KernelPlan.fixed(PACKED).with_prompt("fast")


def test_an_engine_that_splits_marks_its_prefix_cache_keys(tiny_model_dir, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(cpu_planner, "default_table_path", lambda: str(tmp_path / "kernels.json"))
    fake_split_times(monkeypatch)
    llm = LLM(tiny_model_dir("llama"), quantization="int8", quantize_lm_head=True, num_gpu_blocks=64)
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, LinearLayer) and m.cpu_plan is not None]
    head = model.lm_head
    assert head is not None and head.cpu_plan is not None and head.cpu_plan.prompt is None
    assert [m.cpu_plan and m.cpu_plan.prompt for m in layers if m is not head] == [DENSE] * (len(layers) - 1)
    assert splits_prompt_rows(model.modules()) and llm.engine.runner.splits_prompt_rows
    assert llm.engine.scheduler.kv_cache.keys_mark_prompt
    # Dense layers split nothing, but attention splits where the paged decode kernel serves
    # generated tokens; over a quantized cache it does not, and nothing is marked.
    dense = LLM(tiny_model_dir("llama"), num_gpu_blocks=64).engine.scheduler.kv_cache
    assert dense.keys_mark_prompt == cpu_paged_decode.available()
    unsplit = LLM(tiny_model_dir("llama"), num_gpu_blocks=64, kv_cache_dtype="int8").engine
    assert not unsplit.runner.splits_prompt_rows and not unsplit.scheduler.kv_cache.keys_mark_prompt


@pytest.mark.parametrize(
    "quantization,marked",
    [
        ("int8", True),
        ("int8", False),
        pytest.param(None, True, marks=pytest.mark.skipif(not cpu_paged_decode.available(), reason="no numba")),
    ],
)
def test_a_prompt_repeating_an_answer_reads_the_same_as_on_a_fresh_engine(
    tiny_model_dir, tmp_path, monkeypatch, quantization: str | None, marked: bool
) -> None:
    """Request b's prompt is request a's prompt and answer. On the engine that served a,
    b must give what it gives on a fresh engine: a's answer was computed on the generated
    tokens' kernels, b's prompt runs the prompt tokens', so b may not read a's blocks of
    it. Without the marked keys (the second case, forced off, the paged decode kernel
    too) it would, and differs. A dense model (the third) splits only its attention."""
    monkeypatch.setattr(cpu_planner, "default_table_path", lambda: str(tmp_path / "kernels.json"))
    fake_split_times(monkeypatch)
    if not marked:
        monkeypatch.setattr(model_runner, "splits_prompt_rows", lambda modules: False)
        monkeypatch.setattr(cpu_paged_decode._kernel, "function", lambda: None)
    options = {"quantization": quantization, "block_size": 16, "num_gpu_blocks": 64, "max_model_len": 256}
    params = greedy(8, logprobs=3)
    served = LLM(tiny_model_dir("llama"), **options)
    served.engine.runner.splits_prompt_rows = True  # the rows are stated either way
    prompt = [(7 * i) % 400 + 3 for i in range(40)]
    (answer,) = served.generate([prompt], greedy(40))
    follow_up = prompt + list(answer.outputs[0].token_ids)  # 80 tokens: blocks 2-4 hold answer tokens
    (warm,) = served.generate([follow_up], params)
    (cold,) = LLM(tiny_model_dir("llama"), **options).generate([follow_up], params)
    same = (warm.outputs[0].token_ids, warm.outputs[0].logprobs) == (
        cold.outputs[0].token_ids,
        cold.outputs[0].logprobs,
    )
    assert same == marked
