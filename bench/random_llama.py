"""Llama checkpoints with random weights, for benchmarking without downloading one.

Throughput does not depend on the weight values, and this machine has no internet to
download the real SmolLM2-135M, so the benchmark builds a model of the same shape from a
config and saves it once under bench/out/models/ (git-ignored).
"""
from __future__ import annotations

import gc
import os
import shutil
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

CACHE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "models")

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


def build_random_model(name: str, shape: dict[str, Any]) -> str:
    """Save a seeded random LlamaForCausalLM with `shape` once; return its folder."""
    path = os.path.join(CACHE_DIR, name)
    # The marker is written last, so a build that was interrupted is redone, not reused.
    if os.path.isfile(os.path.join(path, ".complete")):
        return path

    print(f"building random-weight model {name} into {path} (once) ...", flush=True)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape)).to(torch.float32)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    open(os.path.join(tmp, ".complete"), "w").close()
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    # Free the weights before the engines under test load their own copies.
    del model
    gc.collect()
    return path
