"""Our Llama-family model vs transformers on tiny random checkpoints.

Attention here is a test-only stand-in for the paged backend: plain causal SDPA per
sequence (with the sliding window when the spec has one), so these tests check the
model, config parsing, RoPE and weight loading independently of the real backend.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from cadence.engine.loader import load_model
from cadence.engine.model_config import ModelConfig
from cadence.engine.models.rotary import _inv_freq
from cadence.engine.precision import Precision, resolve_precision
from cadence.kernels.cpu import bf16_dot
from cadence.kernels.cpu.half_linear import native_bf16
from tests.support.sdpa_contexts import CachedSdpaContext, VarlenSdpaContext
from tests.support.tiny_models import KINDS, make_tiny_model

# Max abs logit difference allowed, relative to the largest |logit| (~45 here). Against
# transformers' eager attention we measure 0 (bitwise equal) for most kinds and ~1e-6
# for qwen3; against its SDPA path ~3e-6. So this leaves ~10x headroom.
LOGIT_RTOL = 1e-5
PROMPT_LENS = (1, 7, 33, 100)


@pytest.fixture(scope="module", params=KINDS)
def tiny(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, str, Any, PreTrainedModel]:
    """(kind, folder, our model, HF reference model) for each tiny checkpoint kind."""
    kind = request.param
    path = make_tiny_model(kind, tmp_path_factory.mktemp(kind))
    ours, _ = load_model(path, torch.float32, "cpu")
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return kind, path, ours, ref


def _prompt(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _ours_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    ctx = VarlenSdpaContext(model.attention_spec(), [ids.numel()])
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(ids.numel()), ctx))


def test_logits_match_transformers(tiny: tuple[str, str, Any, PreTrainedModel]) -> None:
    kind, _, ours, ref = tiny
    for n in PROMPT_LENS:
        ids = _prompt(n, seed=n)
        with torch.no_grad():
            expected = ref(ids[None]).logits[0].float()
        got = _ours_logits(ours, ids)
        assert got.dtype == torch.float32 and got.shape == expected.shape
        diff = (got - expected).abs().max().item()
        tol = LOGIT_RTOL * expected.abs().max().item()
        assert diff <= tol, f"{kind} len {n}: max abs logit diff {diff:.2e} > {tol:.2e}"
        assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_flat_batch_equals_each_sequence_alone(tiny: tuple[str, str, Any, PreTrainedModel]) -> None:
    _, _, ours, _ = tiny
    lens = [5, 1, 37, 12]
    prompts = [_prompt(n, seed=100 + i) for i, n in enumerate(lens)]
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.no_grad():
        flat = ours.compute_logits(ours(ids, positions, VarlenSdpaContext(ours.attention_spec(), lens)))
    for part, p in zip(flat.split(lens), prompts):
        alone = _ours_logits(ours, p)
        assert (part - alone).abs().max().item() < 1e-4


def test_incremental_decode_matches_full_prefill(tiny: tuple[str, str, Any, PreTrainedModel]) -> None:
    """Prefill then one token at a time at positions n, n+1, ... equals one big prefill."""
    _, _, ours, _ = tiny
    ids = _prompt(20, seed=7)
    full = _ours_logits(ours, ids)
    ctx = CachedSdpaContext(ours.attention_spec(), ours.config.num_hidden_layers)
    step_logits = []
    with torch.no_grad():
        for start, end in [(0, 12), (12, 13), (13, 14), (14, 20)]:
            ctx.start = start
            h = ours(ids[start:end], torch.arange(start, end), ctx)
            step_logits.append(ours.compute_logits(h[-1:]))
    assert (torch.cat(step_logits) - full[[11, 12, 13, 19]]).abs().max().item() < 1e-4


def test_attention_spec(tiny: tuple[str, str, Any, PreTrainedModel]) -> None:
    kind, _, ours, ref = tiny
    spec = ours.attention_spec()
    hf = ref.config
    assert spec.num_heads == hf.num_attention_heads
    assert spec.num_kv_heads == hf.num_key_value_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    assert spec.head_dim == head_dim
    assert spec.scale == pytest.approx(head_dim**-0.5)
    assert spec.sliding_window == (8 if kind == "mistral" else None)


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 4.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 128,
        },
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 256,
            "beta_fast": 16,
            "beta_slow": 2,
            "mscale": 1.0,
            "mscale_all_dim": 0.5,
        },
    ],
)
def test_rope_scaling_matches_transformers(tmp_path: Path, rope: dict) -> None:
    raw = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 32,
        "hidden_size": 256,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "max_position_embeddings": 1024,
        "rope_theta": 50000.0,
        "rope_scaling": rope,
    }  # v4-style keys on purpose
    (tmp_path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_pretrained(tmp_path)
    ours, our_scale = _inv_freq(cfg.rope_theta, cfg.head_dim, cfg.rope_scaling, cfg.max_position_embeddings)
    theirs, their_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](AutoConfig.from_pretrained(tmp_path))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert our_scale == pytest.approx(their_scale)


def _raw_config(**overrides: object) -> dict:
    raw = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 32,
        "hidden_size": 64,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
        "sliding_window": 16,
        "use_sliding_window": False,
        "eos_token_id": [3, 4],
        "torch_dtype": "bfloat16",
    }
    raw.update(overrides)
    return raw


def test_config_parsing() -> None:
    cfg = ModelConfig.from_dict(_raw_config())
    assert (cfg.qkv_bias, cfg.o_bias, cfg.qk_norm) == (True, False, False)
    assert cfg.sliding_window is None and cfg.eos_token_id == [3, 4]
    assert cfg.head_dim == 16 and cfg.rope_theta == 10000.0 and cfg.rope_scaling is None
    slide_all = _raw_config(use_sliding_window=True, max_window_layers=0)
    assert ModelConfig.from_dict(slide_all).sliding_window == 16
    # max_window_layers >= num layers: no layer actually slides.
    assert ModelConfig.from_dict(_raw_config(use_sliding_window=True)).sliding_window is None
    with pytest.raises(ValueError, match="mix"):
        ModelConfig.from_dict(_raw_config(use_sliding_window=True, max_window_layers=2))
    v5 = ModelConfig.from_dict(_raw_config(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert v5.rope_theta == 1e6 and v5.rope_scaling is None
    with pytest.raises(ValueError, match="unsupported architecture"):
        ModelConfig.from_dict(_raw_config(architectures=["GPT2LMHeadModel"]))
    with pytest.raises(ValueError, match="rope type"):
        from cadence.engine.models.llama import LlamaForCausalLM

        LlamaForCausalLM(ModelConfig.from_dict(_raw_config(rope_scaling={"rope_type": "longrope", "factor": 2.0})))


def test_resolve_precision() -> None:
    cfg = ModelConfig.from_dict(_raw_config())  # checkpoint stored as bfloat16
    fp32_cfg = ModelConfig.from_dict({**_raw_config(), "torch_dtype": "float32"})
    # On a CPU with bf16dot, "auto" is bf16 for every checkpoint, as vLLM's CPU backend
    # chooses: bf16 weights and products, fp32 activations. Elsewhere float32.
    dot = bf16_dot.hardware_ready()
    for config in (cfg, fp32_cfg):
        auto = resolve_precision("auto", config, "cpu")
        assert auto.bf16_dot_linears == dot
        assert auto.activations == (torch.float32 if dot or not native_bf16() or config is fp32_cfg else torch.bfloat16)
        assert ("bf16dot" in auto.describe()) == dot
    assert resolve_precision("auto", cfg, "cuda") == Precision(torch.bfloat16, False, "auto", torch.bfloat16)
    assert resolve_precision("auto", fp32_cfg, "cuda").activations == torch.float32
    assert resolve_precision("float32", cfg, "cpu") == Precision(torch.float32, False, "float32", torch.bfloat16)
    assert resolve_precision(torch.float32, cfg, "cpu").activations == torch.float32
    assert resolve_precision("float16", cfg, "cpu").activations == torch.float16
    bf16 = resolve_precision("bfloat16", fp32_cfg, "cpu")
    assert (bf16.activations, bf16.bf16_dot_linears) == ((torch.float32, True) if dot else (torch.bfloat16, False))
    with pytest.raises(ValueError):
        resolve_precision("int8", cfg, "cpu")


def test_load_rejects_unknown_and_missing_weights(tiny: tuple[str, str, Any, PreTrainedModel], tmp_path: Path) -> None:
    kind, path, ours, _ = tiny
    from safetensors.torch import load_file, save_file

    weights = load_file(os.path.join(path, "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected weight"):
        ours.load_weights([*weights.items(), ("model.layers.0.mystery.weight", torch.zeros(1))])
    # A bias for a projection built without one is refused as clearly (every kind but
    # llama_bias has bias-free projections).
    bias_free = [n.removesuffix(".weight") for n in weights if n.endswith("_proj.weight")]
    bias_free = [m for m in bias_free if f"{m}.bias" not in weights]
    assert bias_free or kind == "llama_bias"
    for module in bias_free[:1]:
        extra = (f"{module}.bias", torch.ones(weights[f"{module}.weight"].shape[0]))
        with pytest.raises(ValueError, match=f"unexpected tensor '{module}.bias'"):
            ours.load_weights([*weights.items(), extra])
    del weights["model.layers.0.self_attn.k_proj.weight"]
    with pytest.raises(ValueError, match="missing"):
        ours.load_weights(weights.items())
    # Sharded layout: split across two files with an index.
    full = load_file(os.path.join(path, "model.safetensors"))
    names = sorted(full)
    half = len(names) // 2
    shards = {"a.safetensors": names[:half], "b.safetensors": names[half:]}
    for file, keys in shards.items():
        save_file({k: full[k] for k in keys}, str(tmp_path / file))
    index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    shutil.copy(os.path.join(path, "config.json"), tmp_path / "config.json")
    sharded, _ = load_model(tmp_path, torch.float32, "cpu")
    ids = _prompt(9, seed=3)
    assert torch.equal(_ours_logits(sharded, ids), _ours_logits(ours, ids))
