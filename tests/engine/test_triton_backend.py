"""The engine on the Triton attention backend against transformers on the same weights.

Without CUDA the kernels run in Triton's interpreter (conftest sets TRITON_INTERPRET), so
the batches are small; the scheduling cases that mix decodes and prefill chunks in one
kernel launch are the point: ragged prompts, chunked prefill, a prefix-cache hit, n>1,
and a sliding window (the mistral kind).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch

from tests.support.helpers import greedy, hf_greedy, make_llm

MAX_TOKENS = 6
PROMPTS = [[5, 9, 13], [20 + i for i in range(17)], [7, 7, 7, 7, 8], [300 + i for i in range(11)]]


triton_llm = functools.partial(make_llm, attention_backend="triton")


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_triton_backend_matches_transformers(tiny_model_dir: Callable[[str], str], kind: str) -> None:
    path = tiny_model_dir(kind)
    expected = hf_greedy(path, PROMPTS, MAX_TOKENS)
    # A small token budget chunks the 17-token prompt while the others decode.
    llm = triton_llm(path, max_num_batched_tokens=8)
    assert type(llm.engine.runner.backend).__name__ == "TritonAttentionBackend"
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(MAX_TOKENS))] == expected
    # Again: every prompt's full blocks now come from the prefix cache.
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy(MAX_TOKENS))] == expected


def test_triton_backend_n_and_logprobs_match_the_torch_backend(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("qwen2")
    params = greedy(MAX_TOKENS, n=2, logprobs=2)
    triton_out = triton_llm(path).generate(PROMPTS[:2], params)
    torch_out = triton_llm(path, attention_backend="torch").generate(PROMPTS[:2], params)
    for a, b in zip(triton_out, torch_out):
        for ca, cb in zip(a.outputs, b.outputs):
            assert ca.token_ids == cb.token_ids
            for pa, pb in zip(ca.logprobs, cb.logprobs):
                for token_id, entry in pa.items():
                    assert entry.logprob == pytest.approx(pb[token_id].logprob, abs=1e-4)


def test_unknown_or_unavailable_backend_is_refused(
    tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="unknown attention backend"):
        triton_llm(path, attention_backend="flashinfer")
    if not torch.cuda.is_available():
        monkeypatch.delenv("TRITON_INTERPRET")
        with pytest.raises(ValueError, match="needs a CUDA device"):
            triton_llm(path, attention_backend="triton", device="cpu")
