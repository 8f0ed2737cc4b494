"""The CPU's bf16 precision for dense checkpoints (engine/precision.py,
engine/quantization/dense_dot.py): each dense linear, and a head tied to the embedding,
multiplies bf16 weights by bf16-rounded activations with fp32 sums (bf16dot); the weights
are held once, in bf16; the answers are those of that arithmetic, checked against
transformers doing the same roundings."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from cadence.engine.core_setup import kv_layout_of
from cadence.engine.engine_args import EngineArgs
from cadence.engine.loader import load_model
from cadence.engine.model_config import ModelConfig
from cadence.engine.models.causal_lm import CausalLM
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.quantization.linear_layer import DenseMethod, LinearLayer
from cadence.engine.weights_memory import host_weights_bytes
from cadence.kernels.cpu import bf16_dot
from tests.support.helpers import TINY_ENGINE, greedy, make_llm

pytestmark = pytest.mark.skipif(not bf16_dot.hardware_ready(), reason="bf16dot needs a CPU with AVX512-BF16")

PROMPTS = [[5, 17, 99, 3, 250, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [300, 301]]
MAX_TOKENS = 8


def _dense_layers(model: CausalLM) -> list[LinearLayer]:
    return [m for m in model.modules() if isinstance(m, LinearLayer) and type(m.method) is DenseMethod]


@pytest.mark.parametrize("kind", ["llama", "tied"])
def test_dense_weights_are_held_once_in_bf16(tiny_model_dir: Callable[[str], str], kind: str) -> None:
    path = tiny_model_dir(kind)
    model, _ = load_model(path, torch.float32, "cpu", bf16_dot_linears=True)
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    layers = _dense_layers(model)
    assert layers
    for layer in layers:
        assert layer.cpu_dot is not None and not hasattr(layer, "weight")  # no unpacked copy
        held = layer.dequantized_weight(torch.float32)
        assert held.dtype == torch.float32
        rows = [reference[layer.tensor_name(shard, "weight")] for shard in range(len(layer.shard_names))]
        assert torch.equal(held, torch.cat(rows).to(torch.bfloat16).float()), layer.prefix
    # What the KV cache's size leaves aside for the weights counts the packed ones.
    packed = sum(layer.cpu_dot.blocks.nbytes for layer in layers if layer.cpu_dot is not None)
    assert isinstance(model, LlamaForCausalLM)
    if model.cpu_head_dot is not None:
        packed += model.cpu_head_dot.blocks.nbytes
    assert host_weights_bytes(model) == packed + sum(p.numel() * p.element_size() for p in model.parameters())
    tied = kind == "tied"
    assert (model.cpu_head_dot is not None) == tied
    assert (model.lm_head is None) == tied


def _bf16_reference(path: str) -> nn.Module:
    """transformers' model computing what bf16dot computes: every Linear's weight and input
    rounded to bf16, products and sums in fp32 (fp32 elsewhere)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            # A new Parameter: a tied head's rounding must not reach the embedding it shares.
            module.weight = nn.Parameter(module.weight.data.to(torch.bfloat16).float(), requires_grad=False)
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).float(),))
    return model


@pytest.mark.parametrize("kind", ["llama", "tied", "llama_bias"])
def test_greedy_tokens_and_logprobs_are_the_bf16_arithmetics(tiny_model_dir: Callable[[str], str], kind: str) -> None:
    path = tiny_model_dir(kind)
    llm = make_llm(path, dtype="bfloat16")
    assert llm.engine.precision.bf16_dot_linears and llm.engine.dtype == torch.float32
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(MAX_TOKENS, logprobs=1))
    reference = _bf16_reference(path)
    errors = []
    for prompt, output in zip(PROMPTS, outputs):
        completion = output.outputs[0]
        ids = torch.tensor([prompt + completion.token_ids])
        with torch.no_grad():
            logits = reference(ids).logits[0, len(prompt) - 1 : -1]
        assert completion.token_ids == logits.argmax(-1).tolist()
        expected = logits.log_softmax(-1)
        assert completion.logprobs is not None
        for step, (token, logprob) in enumerate(zip(completion.token_ids, completion.logprobs)):
            errors.append(abs(logprob[token].logprob - expected[step, token].item()))
    # Only the order of fp32 sums differs from the reference, which now and then moves an
    # activation across a bf16 rounding boundary (one step in 24 here, by under 0.01); the
    # same logprobs computed in plain fp32 differ by up to 0.16.
    errors.sort()
    assert errors[int(0.8 * len(errors))] < 1e-4 and errors[-1] < 0.02, errors


def test_auto_runs_a_float32_checkpoint_in_bf16_and_float32_keeps_it(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")  # stored as float32
    auto = make_llm(path, dtype="auto").engine
    assert auto.precision.bf16_dot_linears and "as vLLM does" in auto.precision.describe()
    full = make_llm(path, dtype="float32").engine
    assert not full.precision.bf16_dot_linears
    assert all(layer.cpu_dot is None for layer in _dense_layers(full.model))
    assert TINY_ENGINE["dtype"] == "float32"  # the tiny engines compare with transformers in fp32


def test_load_time_quantization_stages_bf16_and_counts_only_the_weights(tiny_model_dir: Callable[[str], str]) -> None:
    """Layers quantized at load stage the checkpoint in bf16 (the peak is the bf16 model),
    and their planner's bf16dot copies are not counted as weights (the KV budget)."""
    model, _ = load_model(tiny_model_dir("llama"), torch.float32, "cpu", "int8", bf16_dot_linears=True)
    quantized = [m for m in model.modules() if isinstance(m, LinearLayer) and type(m.method) is not DenseMethod]
    assert quantized and all(layer.dense_dtype == torch.bfloat16 for layer in quantized)
    assert all(layer.cpu_kernel == "bf16dot" and layer.cpu_dot is not None for layer in quantized)
    assert isinstance(model, nn.Module)
    own = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    dense = sum(layer.cpu_dot.blocks.nbytes for layer in _dense_layers(model) if layer.cpu_dot is not None)
    assert host_weights_bytes(model) == own + dense


def test_a_disaggregated_pair_must_agree_on_the_precision(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    args = EngineArgs(model=path, kv_role="prefill")
    config = ModelConfig.from_pretrained(path)
    spec = LlamaForCausalLM(config).attention_spec()
    bf16 = kv_layout_of(args, config, spec, torch.float32, "bf16dot")
    fp32 = kv_layout_of(args, config, spec, torch.float32, "float32")
    assert bf16.mismatch(bf16) is None
    mismatch = fp32.mismatch(bf16)
    assert mismatch is not None and "precision" in mismatch
