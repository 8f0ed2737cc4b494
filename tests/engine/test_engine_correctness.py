"""The engine against transformers on the same tiny random weights.

Greedy tokens must match exactly, whatever the batching: continuous arrival, chunked
prefill, prefix-cache hits, preemption and n>1 forking are all scheduling choices that
must not change a single token. Logprobs must match HF's log_softmax in fp32.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from cadence import SamplingParams
from cadence.engine.engine_args import EngineArgs
from cadence.engine.engine_core import EngineCore
from cadence.engine.outputs import RequestOutput
from cadence.engine.protocol import EngineCoreRequest
from tests.support.helpers import greedy, hf_greedy, make_llm

KINDS = ["llama", "qwen2", "qwen3", "mistral"]  # mistral: sliding window of 8
MAX_TOKENS = 12
# Lengths chosen to straddle block boundaries (make_llm's blocks hold 4 tokens).
PROMPTS = [
    [5, 9, 13],
    [20 + i for i in range(17)],
    [100 + 3 * i for i in range(8)],
    [7, 7, 7, 7, 8],
    [300 + i for i in range(29)],
]
# fp32 against fp32: logprob errors follow logit errors, which scale with the logits'
# magnitude (about 45 for these peaked models). On CPU we match to ~1e-6; a CUDA GEMM
# differs from the CPU one by a few 1e-6 of that scale.
LOGIT_RELATIVE_TOLERANCE = 1e-5


@pytest.fixture(scope="module", params=KINDS)
def model_and_reference(
    request: pytest.FixtureRequest, tiny_model_dir: Callable[[str], str]
) -> tuple[str, list[list[int]]]:
    path = tiny_model_dir(request.param)
    return path, hf_greedy(path, PROMPTS, MAX_TOKENS)


def tokens(outputs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_greedy_batch_matches_transformers(model_and_reference: tuple[str, list[list[int]]]) -> None:
    path, expected = model_and_reference
    assert tokens(make_llm(path).generate(PROMPTS, greedy(MAX_TOKENS))) == expected


def test_chunked_prefill_gives_same_tokens(model_and_reference: tuple[str, list[list[int]]]) -> None:
    path, expected = model_and_reference
    llm = make_llm(path, max_num_batched_tokens=6)
    assert tokens(llm.generate(PROMPTS, greedy(MAX_TOKENS))) == expected


def test_prefix_cache_hit_gives_same_tokens(model_and_reference: tuple[str, list[list[int]]]) -> None:
    path, expected = model_and_reference
    llm = make_llm(path)
    llm.generate(PROMPTS, greedy(MAX_TOKENS))
    again = llm.generate(PROMPTS, greedy(MAX_TOKENS))
    assert tokens(again) == expected
    assert again[1].num_cached_tokens == 16  # 17-token prompt: four full blocks reused


def test_preemption_with_recompute_gives_same_tokens(model_and_reference: tuple[str, list[list[int]]]) -> None:
    path, expected = model_and_reference
    # 12 blocks of 4 tokens hold only a few of the sequences at once.
    llm = make_llm(path, num_gpu_blocks=12, max_model_len=48, enable_prefix_caching=False)
    assert tokens(llm.generate(PROMPTS, greedy(MAX_TOKENS))) == expected
    assert llm.engine.stats().num_preemptions > 0


def test_continuous_arrival_gives_same_tokens(model_and_reference: tuple[str, list[list[int]]]) -> None:
    path, expected = model_and_reference
    engine = EngineCore(EngineArgs(path, dtype="float32", block_size=4, max_model_len=128, num_gpu_blocks=256))
    produced: dict[str, list[int]] = {}
    pending = list(enumerate(PROMPTS))
    while pending or engine.has_unfinished_requests():
        if pending:  # one new request every step, joining a batch in flight
            index, prompt = pending.pop(0)
            engine.add_request(EngineCoreRequest(str(index), prompt, greedy(MAX_TOKENS)))
        for out in engine.step():
            produced.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.scheduler.check_integrity()
    assert [produced[str(i)] for i in range(len(PROMPTS))] == expected
    assert engine.scheduler.kv_cache.usage == 0.0


def test_n_greater_than_one_shares_the_prompt(model_and_reference: tuple[str, list[list[int]]]) -> None:
    path, expected = model_and_reference
    out = make_llm(path).generate(PROMPTS[1], greedy(MAX_TOKENS, n=3))[0]
    assert [c.token_ids for c in out.outputs] == [expected[1]] * 3
    assert [c.index for c in out.outputs] == [0, 1, 2]


def test_logprobs_match_transformers(model_and_reference: tuple[str, list[list[int]]]) -> None:
    path, _ = model_and_reference
    prompt = PROMPTS[4]
    out = make_llm(path, max_num_batched_tokens=8).generate(prompt, greedy(4, logprobs=5, prompt_logprobs=3))[0]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    full = torch.tensor([prompt + out.outputs[0].token_ids[:-1]])
    with torch.no_grad():
        logits = model(full).logits[0].float()
    reference = torch.log_softmax(logits, dim=-1)
    tolerance = dict(abs=LOGIT_RELATIVE_TOLERANCE * logits.abs().max().item())
    assert out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        token = prompt[position]
        assert entry[token].logprob == pytest.approx(reference[position - 1, token].item(), **tolerance)
        top = reference[position - 1].topk(3).indices.tolist()
        assert set(top) <= set(entry)
    for step, entry in enumerate(out.outputs[0].logprobs):
        row = reference[len(prompt) - 1 + step]
        chosen = out.outputs[0].token_ids[step]
        assert entry[chosen].rank == 1 and chosen == int(row.argmax())
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(row[token_id].item(), **tolerance)
        assert len(entry) == 5


def test_seeded_sampling_is_reproducible_across_batch_mixes(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    llm = make_llm(path)
    seeded = SamplingParams(max_tokens=10, temperature=8.0, top_p=0.9, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[2], seeded)[0].outputs[0].token_ids
    noise = SamplingParams(max_tokens=6, temperature=8.0, ignore_eos=True)
    mixed = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[4]], [noise, seeded, noise])
    assert mixed[1].outputs[0].token_ids == alone
    other_seed = llm.generate(
        PROMPTS[2], SamplingParams(max_tokens=10, temperature=8.0, top_p=0.9, seed=99, ignore_eos=True)
    )
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_strings_and_eos(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    llm = make_llm(path)
    plain = llm.generate("Paris is the capital", greedy(16))[0].outputs[0]
    assert plain.text and plain.finish_reason == "length"
    stop = plain.text[len(plain.text) // 2 : len(plain.text) // 2 + 2]
    cut = llm.generate("Paris is the capital", greedy(16, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == plain.text[: plain.text.index(stop)]
    first = plain.token_ids[0]
    ended = llm.generate("Paris is the capital", SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[first]))
    assert ended[0].outputs[0].token_ids == [first] and ended[0].outputs[0].finish_reason == "stop"
    assert llm.engine.scheduler.kv_cache.usage == 0.0


def test_bad_input_raises_and_engine_stays_usable(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    llm = make_llm(path, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([PROMPTS[0], list(range(40))], greedy(MAX_TOKENS))
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([[1, 2, 100_000]], greedy(MAX_TOKENS))
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate(PROMPTS[0], SamplingParams(max_tokens=-1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], greedy(MAX_TOKENS))
    assert not llm.engine.has_unfinished_requests()
    expected = hf_greedy(path, [PROMPTS[0]], MAX_TOKENS)
    assert tokens(llm.generate(PROMPTS[0], greedy(MAX_TOKENS))) == expected
