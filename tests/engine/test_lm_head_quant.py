"""The int8 LM head (``--quantize-lm-head``) and the tied embedding that reads its rows.

Tolerances, relative Frobenius error of the logits:
* against a dense model holding the head's dequantized int8 values: 1e-2. What is left is
  the bf16 activations and output of the CPU packed op (measured 2.9e-3).
* against the dense model: 5e-2, the quantization error itself. Measured 6.5e-3 for an
  untied head and 1.0-2.1e-2 tied, where the embedding's error also runs through every
  layer of this random model.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeGuard

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch import nn

from cadence.engine.engine_args import EngineArgs
from cadence.engine.gguf_loader import convert_gguf
from cadence.engine.llm import LLM
from cadence.engine.models.llama import LlamaForCausalLM
from cadence.engine.quantization import lm_head
from cadence.engine.quantization.gguf_native import open_source_gguf
from cadence.engine.quantization.linear import Int4Method, Int8Method
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.engine.quantization.lm_head import Int8Embedding
from cadence.kernels.formats.quant_formats import dequantize_int8, quantize_int8
from cadence.tools import gptq_model
from tests.support.gguf_writer import write_tiny_gguf_in
from tests.support.helpers import CPU_PATH_TOL, dense_embedding, head_of, load_llama, rel_err
from tests.support.quant_eval import TINY_PROMPTS, dense_sample, greedy_tokens, perplexity, prefix_agreement, tiny_llm
from tests.support.sdpa_contexts import VarlenSdpaContext
from tests.support.tiny_models import build_tiny_model

QUANT_TOL = 5e-2


def is_int8(head: nn.Module | None) -> TypeGuard[LinearLayer]:
    return isinstance(head, LinearLayer) and isinstance(head.method, Int8Method)


def logits_of(model: LlamaForCausalLM, ids: list[int]) -> torch.Tensor:
    """Full-prompt logits through our model with test-only SDPA attention."""
    device = model.model.norm.weight.device
    tokens = torch.tensor(ids, device=device)
    ctx = VarlenSdpaContext(model.attention_spec(), [len(ids)])
    with torch.no_grad():
        return model.compute_logits(model(tokens, torch.arange(len(ids), device=device), ctx))


@pytest.mark.parametrize("kind", ["llama", "tied"])
def test_int8_head_tracks_the_dense_logits(tiny_model_dir: Callable[[str], str], kind: str) -> None:
    dense = load_llama(tiny_model_dir(kind), torch.float32, "cpu")
    model = load_llama(tiny_model_dir(kind), torch.float32, "cpu", quantize_lm_head=True)
    assert is_int8(model.lm_head)
    dense_head = dense_embedding(dense) if kind == "tied" else head_of(dense).weight
    # Per vocabulary row: every weight within half a quantization step of the dense one.
    err = (model.lm_head.dequantized_weight(torch.float32) - dense_head).abs()
    assert bool((err <= model.lm_head.scale[:, None] / 2 * (1 + 1e-6)).all())
    reference = load_llama(tiny_model_dir(kind), torch.float32, "cpu")
    reference_head = dense_embedding(reference) if kind == "tied" else head_of(reference).weight
    reference_head.copy_(model.lm_head.dequantized_weight(torch.float32))
    for prompt in TINY_PROMPTS:
        got = logits_of(model, prompt)
        assert rel_err(got, logits_of(reference, prompt)) < CPU_PATH_TOL
        assert rel_err(got, logits_of(dense, prompt)) < QUANT_TOL


def test_a_tied_embedding_reads_the_heads_int8_rows(tiny_model_dir: Callable[[str], str]) -> None:
    model = load_llama(tiny_model_dir("tied"), torch.float32, "cpu", quantize_lm_head=True)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, Int8Embedding) and embedding.table is model.lm_head
    head = head_of(model)
    # The dense table is gone: the only vocabulary-sized tensors are the head's int8 rows.
    vocab = model.config.vocab_size
    big = {name for name, t in model.state_dict().items() if t.shape[0] == vocab}
    assert big == {
        "lm_head.qweight",
        "lm_head.scale",
        "model.embed_tokens.table.qweight",
        "model.embed_tokens.table.scale",
    }
    ids = torch.tensor([[0, 5, vocab - 1], [7, 7, 2]])
    expected = dequantize_int8(head.qweight, head.scale, torch.float32)[ids]
    got = embedding(ids)
    assert got.dtype == torch.float32 and torch.equal(got, expected)
    # An untied model keeps its dense embedding: only the head changes.
    untied = load_llama(tiny_model_dir("llama"), torch.float32, "cpu", quantize_lm_head=True)
    assert type(untied.model.embed_tokens) is nn.Embedding


def test_int8_head_on_a_quantized_body_serves_end_to_end(tiny_model_dir: Callable[[str], str]) -> None:
    """The int8 head costs the int8 body almost nothing in perplexity on the model's own
    sample text. Greedy agreement is printed, not bounded: on this random model four
    8-token continuations move by a quarter between kernel choices of equal accuracy
    (dense 0.41-0.50 with the head, 0.63-0.72 without, on CPU and on an H100)."""
    path = tiny_model_dir("tied")
    dense = tiny_llm(path, None)
    text = dense_sample(dense)
    dense_ppl = perplexity(dense, text)
    engines = {}
    for head in (False, True):
        engines[head] = LLM(
            path,
            dtype="float32",
            quantization="int8",
            quantize_lm_head=head,
            block_size=4,
            max_model_len=256,
            num_gpu_blocks=256,
            cpu_kernels="packed",  # the body's packed kernels at every batch size
        )
    assert is_int8(getattr(engines[True].engine.model, "lm_head", None))
    body_ppl, both_ppl = perplexity(engines[False], text), perplexity(engines[True], text)
    reference = greedy_tokens(dense, TINY_PROMPTS, max_tokens=8)
    agreement = prefix_agreement(reference, greedy_tokens(engines[True], TINY_PROMPTS, max_tokens=8))
    print(
        f"tiny tied model: perplexity dense {dense_ppl:.3f}, int8 body {body_ppl:.3f}, with the int8 head "
        f"{both_ppl:.3f}; greedy agreement with dense {agreement:.2f}"
    )
    # Measured on CPU: +0.8% and -0.3% over the body alone (packed and dense kernels); the
    # int8 body itself is +9-12% over dense. A wrong scale or row would cost orders more.
    assert both_ppl < 1.05 * body_ppl
    assert body_ppl < 1.25 * dense_ppl


def test_the_head_is_quantized_in_row_chunks_without_changing_it(
    tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    dense = load_llama(tiny_model_dir("llama"), torch.float32, "cpu")
    qweight, scale = quantize_int8(head_of(dense).weight, torch.float32)
    monkeypatch.setattr(lm_head, "ROWS_PER_CHUNK", 100)  # 512 rows: five full chunks and a partial one
    head = head_of(load_llama(tiny_model_dir("llama"), torch.float32, "cpu", quantize_lm_head=True))
    assert torch.equal(head.qweight, qweight) and torch.equal(head.scale, scale)


def test_quantize_lm_head_option_is_validated_and_parsed() -> None:
    from cadence.server.cli import build_parser

    assert EngineArgs(model="m").quantize_lm_head is None
    with pytest.raises(ValueError, match="quantize_lm_head must be True, False or None"):
        EngineArgs(model="m", quantize_lm_head="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="quantize_lm_head must be"):
        EngineArgs(model="m", quantize_lm_head=1)  # type: ignore[arg-type]
    parse = build_parser().parse_args
    assert parse(["serve"]).quantize_lm_head is None
    assert parse(["serve", "--quantize-lm-head"]).quantize_lm_head is True
    assert parse(["serve", "--no-quantize-lm-head"]).quantize_lm_head is False


def head_q8_0(name: str) -> Q:
    """Only the embedding (the tied head) in Q8_0, everything else F32."""
    return Q.Q8_0 if name == "token_embd.weight" else Q.F32


@pytest.fixture(scope="module")
def tied_q8_head_gguf(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = tmp_path_factory.mktemp("gguf-head")
    path = write_tiny_gguf_in(root, build_tiny_model("tied"), "tied-q8-head.gguf", head_q8_0)
    return convert_gguf(path, str(root / "cache"))


def test_gguf_head_stored_quantized_is_served_int8_by_default(tied_q8_head_gguf: str) -> None:
    model = load_llama(tied_q8_head_gguf, torch.bfloat16, quantization="gguf")
    assert is_int8(model.lm_head) and isinstance(model.model.embed_tokens, Int8Embedding)
    # Re-quantized from the file's block values, not from the bf16-rounded dense copy.
    reader = gguf.GGUFReader(open_source_gguf(tied_q8_head_gguf)[0])
    raw = next(t for t in reader.tensors if t.name == "token_embd.weight")
    exact = torch.from_numpy(gguf.quants.dequantize(raw.data, Q.Q8_0).reshape(model.config.vocab_size, -1).copy())
    err = (model.lm_head.dequantized_weight(torch.float32) - exact).abs()
    assert bool((err <= model.lm_head.scale[:, None] / 2 * (1 + 1e-6)).all())
    # Opting out, or loading dense, keeps the head as the converted folder has it.
    kept = load_llama(tied_q8_head_gguf, torch.float32, quantization="gguf", quantize_lm_head=False)
    assert kept.lm_head is None and type(kept.model.embed_tokens) is nn.Embedding
    dense = load_llama(tied_q8_head_gguf, torch.float32)
    assert dense.lm_head is None and type(dense.model.embed_tokens) is nn.Embedding


def test_gguf_head_stored_as_floats_stays_dense(tmp_path: Path) -> None:
    path = write_tiny_gguf_in(tmp_path, build_tiny_model("tied"), "f32-head.gguf", lambda name: Q.F32)
    model = load_llama(convert_gguf(path, str(tmp_path / "cache")), torch.float32, quantization="gguf")
    assert model.lm_head is None and type(model.model.embed_tokens) is nn.Embedding


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["llama", "tied"])
def test_int8_head_on_gpu_matches_cpu(tiny_model_dir: Callable[[str], str], kind: str) -> None:
    """On CUDA the head runs the W8A16 Triton kernels (vocab 512 rows, M = 1 and a prompt)."""
    cpu = load_llama(tiny_model_dir(kind), torch.float32, "cpu")
    gpu = load_llama(tiny_model_dir(kind), torch.float16, "cuda", quantize_lm_head=True)
    for prompt in TINY_PROMPTS:
        got = logits_of(gpu, prompt).cpu()
        assert rel_err(got, logits_of(cpu, prompt)) < QUANT_TOL
        assert rel_err(logits_of(gpu, prompt[:1]).cpu(), logits_of(cpu, prompt[:1])) < QUANT_TOL


@pytest.mark.parametrize("kind", ["llama", "tied"])
def test_gptq_checkpoint_with_a_quantized_head_loads_it(
    tiny_model_dir: Callable[[str], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """GPTQ's ``lm_head: true``: ``lm_head.qweight`` & co. become an int4 head. With
    tied embeddings the lookup table stays dense (the checkpoint stores it as such)."""
    import json
    import os

    from safetensors.torch import load_file, save_file

    from cadence.kernels.formats.quant_formats import dequantize_int4, quantize_int4, to_gptq

    source = tiny_model_dir(kind)
    out = str(tmp_path / "gptq-head")
    gptq_model.quantize_checkpoint(source, out, group_size=32, num_samples=2, sample_length=16)
    dense = load_llama(source, torch.float32)
    head = dense_embedding(dense) if kind == "tied" else head_of(dense).weight
    int4_head = quantize_int4(head, 32, symmetric=True, scale_dtype=torch.float16)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    tensors.pop("lm_head.weight", None)
    tensors.update({f"lm_head.{k}": v for k, v in to_gptq(int4_head).items()})
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    config["quantization_config"]["lm_head"] = True
    with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    monkeypatch.setattr(Int4Method, "convert_for_cpu", lambda self, layer: None)
    model = load_llama(out, torch.float32)
    assert isinstance(model.lm_head, LinearLayer) and isinstance(model.lm_head.method, Int4Method)
    if kind == "llama":  # an int8 head on top of the checkpoint's int4 one is refused, clearly
        with pytest.raises(ValueError, match="already quantized"):
            load_llama(out, torch.float32, quantize_lm_head=True)
    assert model.lm_head.scales is not None  # kept in our layout: not repacked for the CPU op
    assert torch.equal(model.lm_head.qweight, int4_head.qweight) and torch.equal(model.lm_head.scales, int4_head.scales)
    assert type(model.model.embed_tokens) is nn.Embedding
    if kind == "tied":
        assert torch.equal(model.model.embed_tokens.weight, dense_embedding(dense))
    hidden = torch.randn(3, model.config.hidden_size)
    expected = hidden @ dequantize_int4(int4_head, torch.float32).t()
    assert torch.allclose(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)
    # A config that promises a quantized head the tensors do not hold is refused by name.
    save_file(
        {k: v for k, v in tensors.items() if not k.startswith("lm_head.")}, os.path.join(out, "model.safetensors")
    )
    with pytest.raises(ValueError, match="missing quantized weights: lm_head"):
        load_llama(out, torch.float32)
