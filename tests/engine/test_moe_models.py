"""Mixtral, Qwen2-MoE and Qwen3-MoE (engine/models/moe.py) against transformers on tiny
random checkpoints: logits, and greedy tokens through the engine for a ragged batch,
under chunked prefill and under preemption. Also the routing settings parsed from each
config, the fused-kernel path against the grouped one, and int8 experts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from cadence.engine.loader import load_model
from cadence.engine.model_config import ModelConfig
from cadence.engine.models.moe import MoEForCausalLM, SparseMoeBlock, routes_on_host
from cadence.engine.outputs import RequestOutput
from cadence.engine.quantization.linear import Int8Method
from cadence.engine.quantization.linear_layer import DenseMethod
from tests.support.helpers import greedy, hf_greedy, make_llm, rel_err
from tests.support.sdpa_contexts import VarlenSdpaContext
from tests.support.tiny_models import MOE_KINDS

MAX_TOKENS = 10
# Lengths straddle block boundaries (make_llm's blocks hold 4 tokens).
PROMPTS = [
    [5, 9, 13],
    [20 + i for i in range(17)],
    [100 + 3 * i for i in range(8)],
    [300 + i for i in range(29)],
]
LOGIT_RTOL = 1e-5  # as tests/engine/test_models.py: we measure ~2e-6 of the largest |logit|
# An int8 expert (per output channel, K=64) against its dense weights: we measure ~1.2e-2.
INT8_TOL = 3e-2


_REFERENCES: dict[str, list[list[int]]] = {}


def _with_reference(kind: str, tiny_model_dir: Callable[[str], str]) -> tuple[str, str, list[list[int]]]:
    """(kind, folder, transformers' greedy continuations of PROMPTS), computed once per kind."""
    path = tiny_model_dir(kind)
    if kind not in _REFERENCES:
        _REFERENCES[kind] = hf_greedy(path, PROMPTS, MAX_TOKENS)
    return kind, path, _REFERENCES[kind]


@pytest.fixture(scope="module", params=MOE_KINDS)
def moe_model(request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], str]) -> tuple[str, str, list[list[int]]]:
    return _with_reference(request.param, tiny_model_dir)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    ctx = VarlenSdpaContext(model.attention_spec(), [ids.numel()])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.numel(), device=ids.device), ctx))


def test_logits_match_transformers(moe_model: tuple[str, str, list[list[int]]]) -> None:
    kind, path, _ = moe_model
    ours, _ = load_model(path, torch.float32, "cpu")
    assert isinstance(ours, MoEForCausalLM)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids[None]).logits[0].float()
    got = _logits(ours, ids)
    diff, scale = (got - expected).abs().max().item(), expected.abs().max().item()
    assert diff <= LOGIT_RTOL * scale, f"{kind}: max abs logit diff {diff:.2e}"
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_greedy_ragged_batch_matches_transformers(moe_model: tuple[str, str, list[list[int]]]) -> None:
    _, path, expected = moe_model
    assert tokens(make_llm(path).generate(PROMPTS, greedy(MAX_TOKENS))) == expected


def test_chunked_prefill_gives_same_tokens(moe_model: tuple[str, str, list[list[int]]]) -> None:
    _, path, expected = moe_model
    llm = make_llm(path, max_num_batched_tokens=6)
    assert tokens(llm.generate(PROMPTS, greedy(MAX_TOKENS))) == expected


def test_preemption_with_recompute_gives_same_tokens(moe_model: tuple[str, str, list[list[int]]]) -> None:
    _, path, expected = moe_model
    llm = make_llm(path, num_gpu_blocks=12, max_model_len=48, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, greedy(MAX_TOKENS))) == expected
    assert llm.engine.stats().num_preemptions > 0


@pytest.mark.gpu
def test_cuda_matches_transformers(moe_model: tuple[str, str, list[list[int]]]) -> None:
    """On a GPU the dense experts are stacked and run through the fused Triton kernel: the
    logits follow transformers' (on the CPU) to fp32 rounding, and the engine's greedy
    tokens for the ragged batch, with CUDA graphs on, are transformers' tokens."""
    kind, path, expected = moe_model
    ours, _ = load_model(path, torch.float32, "cuda")
    block = next(m for m in ours.modules() if isinstance(m, SparseMoeBlock))
    assert block.w13 is not None  # stacked: the fused path, not the grouped one
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    ids = torch.randint(0, 512, (37,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected_logits = ref(ids[None]).logits[0].float()
    got = _logits(ours, ids.cuda()).cpu()
    assert rel_err(got, expected_logits) < 1e-4, kind
    llm = make_llm(path, device="cuda")
    assert llm.engine.runner.decode_graphs is not None  # no layer reads its routing on the host
    assert tokens(llm.generate(PROMPTS, greedy(MAX_TOKENS))) == expected


def test_routing_settings_follow_each_config(tiny_model_dir: Callable[[str], str]) -> None:
    mixtral = ModelConfig.from_pretrained(tiny_model_dir("mixtral")).moe
    assert mixtral is not None
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.intermediate_size) == (8, 2, 128)
    assert mixtral.renormalize and mixtral.weights_in_fp32 and not mixtral.shared_expert_intermediate_size
    qwen2 = ModelConfig.from_pretrained(tiny_model_dir("qwen2_moe"))
    assert qwen2.moe is not None and qwen2.qkv_bias and not qwen2.o_bias
    assert not qwen2.moe.renormalize and not qwen2.moe.weights_in_fp32
    assert qwen2.moe.shared_expert_intermediate_size == 48
    assert [qwen2.moe.is_sparse(i) for i in range(2)] == [False, True]  # decoder_sparse_step=2
    qwen3 = ModelConfig.from_pretrained(tiny_model_dir("qwen3_moe"))
    assert qwen3.moe is not None and qwen3.moe.renormalize and qwen3.qk_norm
    assert (qwen3.moe.num_experts, qwen3.moe.intermediate_size) == (4, 32)
    assert [qwen3.moe.is_sparse(i) for i in range(2)] == [True, True]


def test_fused_path_matches_grouped_path(tiny_model_dir: Callable[[str], str]) -> None:
    """The CUDA branch (stacked experts through kernels/triton/fused_moe.py; here its CPU path)
    gives the grouped torch path's output, and stacking keeps one copy of the weights."""
    model, _ = load_model(tiny_model_dir("qwen2_moe"), torch.float32, "cpu")
    block = model.get_submodule("model.layers.1.mlp")
    assert isinstance(block, SparseMoeBlock) and block.w13 is None  # not stacked on CPU
    assert block.reads_routing_on_host() and routes_on_host(model)  # so no CUDA graphs
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        grouped = block(x)
        assert block.stack_dense_experts() and block.w13 is not None
        assert not block.reads_routing_on_host()
        first = block.experts[0].get_submodule("gate_up_proj")
        assert first.weight.data_ptr() == block.w13[0].data_ptr()
        fused = block(x)
    assert rel_err(fused, grouped) < 1e-5


def test_int8_experts(tiny_model_dir: Callable[[str], str]) -> None:
    """``--quantization int8`` reaches every expert (each close to its dense weights); the
    routers stay dense, and the model serves."""
    path = tiny_model_dir("mixtral")
    dense, _ = load_model(path, torch.float32, "cpu")
    int8, _ = load_model(path, torch.float32, "cpu", "int8", cpu_kernels="dense")
    block, dense_block = int8.get_submodule("model.layers.0.mlp"), dense.get_submodule("model.layers.0.mlp")
    assert isinstance(block, SparseMoeBlock) and isinstance(dense_block, SparseMoeBlock)
    assert type(block.gate.method) is DenseMethod
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for expert, dense_expert in zip(block.experts, dense_block.experts):
            assert isinstance(expert.get_submodule("down_proj").method, Int8Method)
            assert rel_err(expert(x), dense_expert(x)) < INT8_TOL
    ids = torch.randint(0, 512, (20,), generator=torch.Generator().manual_seed(2))
    assert _logits(int8, ids).isfinite().all()
