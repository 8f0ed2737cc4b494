"""`engine_args_for`, the one front door: `cadence serve [MODEL]` and `LLM(model)` resolve the
model and options through it, so a .gguf file gives the same greedy tokens either way."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from cadence import LLM, SamplingParams
from cadence.engine import default_model
from cadence.engine.engine_args import EngineArgs, engine_args_for
from cadence.engine.quantization.linear import Int8Method
from cadence.server.cli import build_parser, engine_args_from
from tests.support.gguf_writer import write_tiny_gguf_in
from tests.support.server_harness import ServerProcess
from tests.support.tiny_models import build_tiny_model

TEXTS = ["The quick brown fox", "Paris is the capital of"]
SHARED_FLAGS = {"dtype": "float32", "max_model_len": 64, "num_gpu_blocks": 64}


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny llama written as llama.cpp writes a GGUF: layer 0 in F32, the rest in Q8_0."""
    return write_tiny_gguf_in(tmp_path_factory.mktemp("front-door"), build_tiny_model("llama"), "tiny.gguf")


@pytest.fixture()
def cache_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A HOME of its own, so conversions land in a temporary ~/.cache/cadence."""
    monkeypatch.setenv("HOME", str(tmp_path))
    return str(tmp_path)


def test_unknown_option_is_refused_by_name(tiny_model_dir: Callable[[str], str], tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"unknown engine option 'max_num_seq' \(did you mean 'max_num_seqs'\?\)"):
        LLM(tiny_model_dir("llama"), max_num_seq=4)
    with pytest.raises(TypeError, match="unknown engine options 'model_path', 'trust_remote_code'"):
        engine_args_for(tiny_model_dir("llama"), trust_remote_code=True, model_path="x")


def test_options_are_checked_before_any_conversion(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(*args: object) -> None:
        raise AssertionError("converted before the options were checked")

    monkeypatch.setattr(default_model, "convert_gguf", no_conversion)
    missing = str(tmp_path / "model.gguf")
    with pytest.raises(TypeError, match="'bogus'"):
        engine_args_for(missing, bogus=1)
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int3'"):
        engine_args_for(missing, kv_cache_dtype="int3")
    with pytest.raises(ValueError, match="unknown quantization 'int2'"):
        engine_args_for(missing, quantization="int2")


def test_default_quantization_follows_the_model(
    tiny_model_dir: Callable[[str], str], tiny_gguf: str, cache_home: str
) -> None:
    folder = tiny_model_dir("llama")
    assert engine_args_for(folder) == EngineArgs(model=folder)
    assert engine_args_for(folder, quantization="int8").quantization == "int8"
    assert engine_args_for(folder, quantization="none").quantization is None

    converted = engine_args_for(tiny_gguf)
    assert converted.quantization == "gguf"
    assert os.path.dirname(converted.model) == os.path.join(cache_home, ".cache", "cadence")
    assert os.path.isfile(os.path.join(converted.model, "model.safetensors"))
    assert engine_args_for(tiny_gguf, quantization=None).quantization == "gguf"  # None means unset
    assert engine_args_for(tiny_gguf, quantization="none").quantization is None
    assert engine_args_for(tiny_gguf, quantization="NONE").quantization is None
    assert engine_args_for(tiny_gguf, quantization="int4").quantization == "int4"


@pytest.mark.parametrize(
    ("flags", "options"),
    [
        ([], {}),
        (
            ["--dtype", "float32", "--max-num-seqs", "4", "--kv-cache-memory", "1MiB"],
            {"dtype": "float32", "max_num_seqs": 4, "kv_cache_memory": 1 << 20},
        ),
        (
            ["--no-enable-prefix-caching", "--enforce-eager", "--quantization", "none", "--no-quantize-lm-head"],
            {"enable_prefix_caching": False, "enforce_eager": True, "quantization": "none", "quantize_lm_head": False},
        ),
        (["--long-prefill-token-threshold", "64"], {"long_prefill_token_threshold": 64}),
    ],
)
def test_serve_flags_and_llm_options_give_the_same_engine_args(
    tiny_model_dir: Callable[[str], str], flags: list[str], options: dict[str, Any]
) -> None:
    folder = tiny_model_dir("llama")
    from_cli = engine_args_from(build_parser().parse_args(["serve", folder, *flags]))
    assert from_cli == engine_args_for(folder, **options)
    if not flags:
        assert from_cli == EngineArgs(model=folder)  # an unset flag keeps the engine's default


def test_a_negative_long_prefill_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineArgs(model="m", long_prefill_token_threshold=-1)


def test_llm_on_a_gguf_gives_the_servers_greedy_tokens(
    tiny_gguf: str, cache_home: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One CPU kernel table for both (the session's, which ServerProcess hands the server),
    # saved by the first however busy the machine is, as two starts on one machine share
    # ~/.cache/cadence's: starts that measured apart could choose differently at a near
    # tie, and then give other greedy tokens.
    flags = ["--dtype", "float32", "--max-model-len", "64", "--num-gpu-blocks", "64"]
    llm = LLM(tiny_gguf, **SHARED_FLAGS)
    # Served in the file's own blocks by default, as the server does: layers 1+ are Q8_0.
    assert llm.engine.args.quantization == "gguf"
    assert isinstance(llm.engine.model.model.layers[1].self_attn.qkv_proj.method, Int8Method)
    tokenizer = llm.get_tokenizer()
    assert tokenizer is not None  # from the converted folder: the GGUF carries its tokenizer
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [llm.generate(text, params)[0] for text in TEXTS]
    del llm

    with ServerProcess(tiny_gguf, *flags, env={"HOME": cache_home}) as server:
        root = httpx.get(f"{server.base_url}/v1/models").json()["data"][0]["root"]
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)
        for text, offline in zip(TEXTS, expected):
            reply = client.completions.create(
                model=tiny_gguf, prompt=text, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
            )
            assert reply.usage is not None
            assert reply.usage.prompt_tokens == len(offline.prompt_token_ids)
            assert reply.usage.completion_tokens == len(offline.outputs[0].token_ids) == 8
            assert reply.choices[0].text == offline.outputs[0].text
    assert root == engine_args_for(tiny_gguf).model  # both loaded the one cached conversion
