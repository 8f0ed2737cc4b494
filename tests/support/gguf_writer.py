"""Write tiny llama models as GGUF files the way llama.cpp's converter does (tests only).

Q and K rows are permuted into llama.cpp's RoPE layout and the tokenizer goes into the
metadata, so converting the file back must give the original transformers weights.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import gguf
import torch
from transformers import PreTrainedModel

from tests.support.tiny_tokenizer import save_tiny_tokenizer

CHATML = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def llama_cpp_permute(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """llama.cpp's converter layout: each head's two RoPE halves interleaved row by row."""
    half = weight.shape[0] // num_heads // 2
    return weight.reshape(num_heads, 2, half, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


def gguf_tensors(model: PreTrainedModel) -> dict[str, torch.Tensor]:
    """The model's weights under GGUF names, Q and K permuted as llama.cpp does."""
    config = model.config
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    out: dict[str, torch.Tensor] = {}
    for name, value in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            out[
                {
                    "model.embed_tokens.weight": "token_embd.weight",
                    "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight",
                }[name]
            ] = value
            continue
        _, _, layer, rest = name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        if module == "self_attn.q_proj":
            value = llama_cpp_permute(value, config.num_attention_heads)
        elif module == "self_attn.k_proj":
            value = llama_cpp_permute(value, config.num_key_value_heads)
        out[f"blk.{layer}.{parts[module]}.{kind}"] = value
    return out


def tokenizer_metadata(tokenizer_dir: str, vocab_size: int) -> tuple[list[str], list[str], list[int]]:
    """tokens, merges and token types from the tiny tokenizer, padded as llama.cpp pads."""
    with open(os.path.join(tokenizer_dir, "tokenizer.json"), encoding="utf-8") as f:
        data = json.load(f)
    vocab: dict[str, int] = data["model"]["vocab"]
    tokens = [""] * vocab_size
    types = [gguf.TokenType.UNUSED] * vocab_size
    for token, index in vocab.items():
        tokens[index], types[index] = token, gguf.TokenType.NORMAL
    for added in data["added_tokens"]:
        types[added["id"]] = gguf.TokenType.CONTROL
    for index in range(vocab_size):
        if not tokens[index]:
            tokens[index] = f"[PAD{index}]"
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, merges, [int(t) for t in types]


def mixed_q8_0(name: str) -> gguf.GGMLQuantizationType:
    """Layer 0 and the globals in F32, every other layer's matrices in Q8_0."""
    if name.startswith("blk.") and not name.startswith("blk.0."):
        return gguf.GGMLQuantizationType.Q8_0
    return gguf.GGMLQuantizationType.F32


def write_tiny_gguf(
    model: PreTrainedModel,
    tokenizer_dir: str,
    path: str,
    matrix_type: Callable[[str], gguf.GGMLQuantizationType] = mixed_q8_0,
) -> None:
    """The model as llama.cpp would write it; ``matrix_type`` picks each 2-D tensor's type."""
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    tokens, merges, types = tokenizer_metadata(tokenizer_dir, config.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for name, value in gguf_tensors(model).items():
        array = value.detach().float().numpy()
        kind = matrix_type(name) if value.dim() == 2 else gguf.GGMLQuantizationType.F32
        if kind != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_tiny_gguf_in(
    root: Path,
    model: PreTrainedModel,
    filename: str,
    matrix_type: Callable[[str], gguf.GGMLQuantizationType] = mixed_q8_0,
) -> str:
    """The tiny tokenizer saved to ``root / "tokenizer"`` and the model written with it to
    ``root / filename``, as the GGUF tests each need; returns the file's path."""
    save_tiny_tokenizer(root / "tokenizer")
    path = str(root / filename)
    write_tiny_gguf(model, str(root / "tokenizer"), path, matrix_type)
    return path
