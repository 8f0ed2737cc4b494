"""Shared by tests/engine/test_quantization.py and bench/quant.py: a fixed English text and
perplexity / greedy-agreement measurements through the engine's own API."""

from __future__ import annotations

import math
from collections.abc import Sequence

from cadence import LLM, SamplingParams

# A fixed, plain English passage (about 300 SmolLM2 tokens): public-domain-style prose
# written for this test, so the number is reproducible and needs no data set.
EVAL_TEXT = (
    "The river that runs past the old mill is slow in summer and loud in spring. Every year, "
    "when the snow on the hills begins to melt, the water rises over the stones and carries "
    "branches, leaves and the occasional lost boot down toward the town. The miller's family "
    "has lived beside it for more than a hundred years, and they know its moods the way "
    "sailors know the sea. In the mornings the grandmother walks along the bank with a basket, "
    "looking for mushrooms under the willows, while her grandson counts the ducks and tries to "
    "remember which ones he saw the day before. Nobody grinds flour at the mill any more. The "
    "great wheel was stopped long ago, and the building now holds a small museum, a cafe that "
    "opens only on weekends, and a workshop where a carpenter repairs chairs and tables for the "
    "people of the valley. Visitors come to see the machinery, which has been cleaned and painted "
    "so that children can follow how the grain once moved from the sacks to the stones and out "
    "again as flour. A sign near the door explains that the mill was built in 1821, burned in "
    "1890, and was rebuilt within a single year by the whole village working together. In the "
    "evening, when the cafe closes and the visitors drive home, the only sounds are the water, "
    "the wind in the trees and, sometimes, a train crossing the bridge further down the valley. "
    "The family says that this is the best hour of the day, because the light turns gold on the "
    "water and the town seems very far away."
)


def prompt_logprobs(llm: LLM, token_ids: Sequence[int]) -> list[float]:
    """log p(token_i | tokens_<i) for i >= 1, from the engine's prompt logprobs."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": list(token_ids)}], params)[0]
    assert out.prompt_logprobs is not None and out.prompt_logprobs[0] is None
    return [entry[tok].logprob for entry, tok in zip(out.prompt_logprobs[1:], token_ids[1:])]


def perplexity(llm: LLM, token_ids: Sequence[int]) -> float:
    """exp(mean negative log-likelihood) of the text under the model."""
    lps = prompt_logprobs(llm, token_ids)
    return math.exp(-sum(lps) / len(lps))


def greedy_tokens(llm: LLM, prompts: Sequence[Sequence[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations (ignoring EOS, so every sequence has max_tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def prefix_agreement(reference: Sequence[Sequence[int]], other: Sequence[Sequence[int]]) -> float:
    """Mean fraction of each continuation that matches the reference before the first
    difference: once greedy decoding diverges, later tokens are not comparable."""
    fractions = []
    for ref, got in zip(reference, other):
        same = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
        fractions.append(same / len(ref))
    return sum(fractions) / len(fractions)


# ---------------------------------------------------------------- the tiny random model

TINY_PROMPTS = [[1, 5, 9, 33, 100, 7], [1, 250, 251, 3], [1, 42] * 5, [1, 300, 17, 18, 19, 20, 21, 480]]


def tiny_llm(path: str, quantization: str | None) -> LLM:
    return LLM(path, dtype="float32", quantization=quantization, block_size=4, max_model_len=256, num_gpu_blocks=256)


def dense_sample(dense: LLM) -> list[int]:
    """The tiny model's fixed "text": a seeded sample from the dense model itself. Random
    token ids would score a perplexity of ~1e12 on this peaked random model, where any
    change is noise; on its own sample the dense perplexity is ~1.8 and differences mean
    something."""
    sample = SamplingParams(max_tokens=200, temperature=1.0, seed=3, ignore_eos=True)
    return [1] + dense.generate([{"prompt_token_ids": [1]}], sample)[0].outputs[0].token_ids
