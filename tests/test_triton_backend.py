"""The engine on the Triton attention backend against transformers on the same weights.

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET), so
the batches are small; the scheduling cases that mix decodes and prefill chunks in one
kernel launch are the point: ragged prompts, chunked prefill, a prefix-cache hit, n>1,
and a sliding window (the mistral kind).
"""
from __future__ import annotations

import pytest
import torch
from test_engine_correctness import hf_greedy

from cadence import LLM, SamplingParams

MAX_TOKENS = 6
PROMPTS = [[5, 9, 13], [20 + i for i in range(17)], [7, 7, 7, 7, 8], [300 + i for i in range(11)]]


def make_llm(path: str, **kw) -> LLM:
    options = dict(dtype="float32", block_size=4, max_model_len=64, num_gpu_blocks=128, attention_backend="triton")
    options.update(kw)
    return LLM(path, **options)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_triton_backend_matches_transformers(tiny_model_dir, kind: str) -> None:
    path = tiny_model_dir(kind)
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    # A small token budget chunks the 17-token prompt while the others decode.
    llm = make_llm(path, max_num_batched_tokens=8)
    assert type(llm.engine.runner.backend).__name__ == "TritonAttentionBackend"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())] == expected
    # Again: every prompt's full blocks now come from the prefix cache.
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())] == expected


def test_triton_backend_n_and_logprobs_match_the_torch_backend(tiny_model_dir) -> None:
    path = tiny_model_dir("qwen2")
    params = greedy(n=2, logprobs=2)
    triton_out = make_llm(path).generate(PROMPTS[:2], params)
    torch_out = make_llm(path, attention_backend="torch").generate(PROMPTS[:2], params)
    for a, b in zip(triton_out, torch_out):
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            for pa, pb in zip(ca.logprobs, cb.logprobs):
                for token_id, entry in pa.items():
                    assert entry.logprob == pytest.approx(pb[token_id].logprob, abs=1e-4)


def test_unknown_or_unavailable_backend_is_refused(tiny_model_dir, monkeypatch) -> None:
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="unknown attention backend"):
        make_llm(path, attention_backend="flashinfer")
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="needs a CUDA device"):
            make_llm(path, attention_backend="triton", device="cpu")
