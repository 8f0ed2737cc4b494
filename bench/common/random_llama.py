"""Llama checkpoints with random weights, for benchmarking without downloading one.

Throughput does not depend on the weight values, so the benchmarks build a model of the
shape they need from a config and save it once under bench/out/models/ (git-ignored).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CACHE_DIR = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "out", "models"))

# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json).
SMOLLM2_135M: dict[str, Any] = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
    tie_word_embeddings=True,
    rope_theta=100000.0,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    bos_token_id=0,
    eos_token_id=0,
)


def llama3_shaped(hidden: int, intermediate: int, layers: int, kv_heads: int = 8) -> tuple[str, dict[str, Any]]:
    """A Llama-3-style shape (128,256-token vocabulary, untied head; heads of 64 up to a
    hidden size of 2,048 as in Llama-3.2-1B, of 128 above as in Llama-3-8B) and a cache
    name that states every size in it, so that benches sharing a name share the model."""
    head_dim = 64 if hidden <= 2048 else 128
    shape = dict(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=hidden // head_dim,
        num_key_value_heads=kv_heads,
        vocab_size=128256,
        tie_word_embeddings=False,
        rope_theta=500000.0,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
    )
    return f"llama3-h{hidden}-l{layers}-i{intermediate}-d{head_dim}-kv{kv_heads}-bf16", shape


# For --quick: the same architecture, small enough to run in seconds.
TINY: dict[str, Any] = {
    **SMOLLM2_135M,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 1024,
    "max_position_embeddings": 2048,
}


def add_shape_arguments(
    ap: argparse.ArgumentParser, layers: int = 32, hidden: int = 4096, intermediate: int = 14336
) -> None:
    """``--layers``, ``--hidden`` and ``--intermediate`` of a Llama-3-shaped model (8B's by default)."""
    ap.add_argument("--layers", type=int, default=layers)
    ap.add_argument("--hidden", type=int, default=hidden)
    ap.add_argument("--intermediate", type=int, default=intermediate)


def runs_on_gpu(smoke: bool) -> bool:
    """True with a CUDA GPU and no ``--smoke``; False for a smoke run on CPU; exits without a GPU otherwise."""
    on_gpu = torch.cuda.is_available() and not smoke
    if not on_gpu and not smoke:
        raise SystemExit("needs a CUDA GPU (or --smoke)")
    return on_gpu


def build_random_model(name: str, shape: dict[str, Any], fast: bool = False) -> str:
    """Save a seeded random LlamaForCausalLM with `shape` once; return its folder.

    `fast` skips transformers' fp32 model and initializers: bf16 normal(0, 0.02) tensors
    (norms 1) straight to safetensors, on the GPU when there is one. An 8B model then
    builds in seconds instead of needing 32 GB of fp32 on the host.
    """
    path = os.path.join(CACHE_DIR, name)
    # The marker is written last, so a build that was interrupted is redone, not reused.
    if os.path.isfile(os.path.join(path, ".complete")):
        return path

    print(f"building random-weight model {name} into {path} (once) ...", flush=True)
    torch.manual_seed(0)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    if fast:
        _save_fast(LlamaConfig(**shape), tmp)
    else:
        model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.float32)
        model.save_pretrained(tmp, safe_serialization=True)
        del model
    open(os.path.join(tmp, ".complete"), "w").close()
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    # Free the weights before the engines under test load their own copies.
    gc.collect()
    return path


def _save_fast(config: LlamaConfig, folder: str) -> None:
    """HF-named bf16 tensors of random values, one safetensors file per decoder layer."""
    from safetensors.torch import save_file

    device = "cuda" if torch.cuda.is_available() else "cpu"
    h, i, d = config.hidden_size, config.intermediate_size, config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * d

    def rand(*size: int) -> torch.Tensor:
        return (torch.randn(*size, device=device, dtype=torch.bfloat16) * 0.02).cpu()

    os.makedirs(folder)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(folder)
    files = {
        "model.embed_tokens.weight": rand(config.vocab_size, h),
        "model.norm.weight": torch.ones(h, dtype=torch.bfloat16),
    }
    if not config.tie_word_embeddings:
        files["lm_head.weight"] = rand(config.vocab_size, h)
    save_file(files, os.path.join(folder, "model-head.safetensors"))
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        save_file(
            {
                p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                p + "self_attn.q_proj.weight": rand(h, h),
                p + "self_attn.k_proj.weight": rand(kv, h),
                p + "self_attn.v_proj.weight": rand(kv, h),
                p + "self_attn.o_proj.weight": rand(h, h),
                p + "mlp.gate_proj.weight": rand(i, h),
                p + "mlp.up_proj.weight": rand(i, h),
                p + "mlp.down_proj.weight": rand(h, i),
            },
            os.path.join(folder, f"model-layer{layer:03d}.safetensors"),
        )
