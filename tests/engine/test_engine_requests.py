"""Request lifecycle through the engine: aborts, stop rules, penalties, cache sizing."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from cadence import LLM, SamplingParams
from cadence.engine.engine_args import EngineArgs
from cadence.engine.engine_core import EngineCore
from cadence.engine.protocol import EngineCoreRequest
from tests.support.helpers import TINY_ENGINE, greedy

PROMPT = [11, 42, 7, 99, 23, 5, 64]
MAX_TOKENS = 10


def make_engine(path: str, **kw: Any) -> EngineCore:
    return EngineCore(EngineArgs(path, **{**TINY_ENGINE, **kw}))


def test_abort_mid_flight_frees_blocks_and_spares_the_rest(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    engine = make_engine(path)
    engine.add_request(EngineCoreRequest("keep", PROMPT, greedy(MAX_TOKENS)))
    engine.add_request(EngineCoreRequest("drop", PROMPT[:3], greedy(max_tokens=30)))
    engine.add_request(EngineCoreRequest("pair", PROMPT, greedy(n=2, max_tokens=30)))
    produced: dict[str, list[int]] = {}
    for step in range(40):
        if step == 3:
            engine.abort_requests(["drop", engine.sequence_id("pair", 1)])
        if step == 6:
            engine.abort_requests(["pair"])
        for out in engine.step():
            produced.setdefault(f"{out.request_id}/{out.index}", []).extend(out.new_token_ids)
        engine.scheduler.check_integrity()
        if not engine.has_unfinished_requests():
            break
    assert engine.scheduler.kv_cache.usage == 0.0
    reference = (
        LLM(path, dtype="float32", max_model_len=64).generate(PROMPT, greedy(MAX_TOKENS))[0].outputs[0].token_ids
    )
    assert produced["keep/0"] == reference
    assert len(produced["drop/0"]) < 30 and len(produced["pair/0"]) < 30
    assert engine.stats().num_running == engine.stats().num_waiting == 0


def test_min_tokens_holds_stop_tokens_back(tiny_model_dir: Callable[[str], str]) -> None:
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64)
    plain = llm.generate(PROMPT, greedy(MAX_TOKENS))[0].outputs[0].token_ids
    stop_id = plain[0]
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id]))
    assert stopped[0].outputs[0].token_ids == [stop_id]
    held = llm.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_id], min_tokens=3))
    tokens = held[0].outputs[0].token_ids
    assert len(tokens) >= 3 and stop_id not in tokens[:3]
    assert (tokens[-1] == stop_id) == (held[0].outputs[0].finish_reason == "stop")


def test_repetition_penalty_matches_transformers(tiny_model_dir: Callable[[str], str]) -> None:
    # Below 1 the penalty favours seen tokens, which visibly changes this model's greedy
    # path (it never repeats on its own, so a penalty above 1 would change nothing).
    penalty = 0.7
    path = tiny_model_dir("qwen2")
    llm = LLM(path, dtype="float32", max_model_len=64)
    ours = llm.generate(PROMPT, greedy(max_tokens=16, repetition_penalty=penalty))
    assert ours[0].outputs[0].token_ids != llm.generate(PROMPT, greedy(max_tokens=16))[0].outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = model.generate(
        torch.tensor([PROMPT]),
        max_new_tokens=16,
        do_sample=False,
        repetition_penalty=penalty,
        eos_token_id=None,
        pad_token_id=0,
    )[0, len(PROMPT) :].tolist()
    assert ours[0].outputs[0].token_ids == expected


def test_kv_cache_is_sized_from_memory(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")  # 3 layers, 2 KV heads of 16 dims, float32
    bytes_per_block = 2 * 4 * 2 * 16 * 4 * 3
    engine = make_engine(path, num_gpu_blocks=None, kv_cache_memory=100 * bytes_per_block + 7)
    assert engine.scheduler.kv_cache.pool.num_blocks == 100
    automatic = make_engine(path, num_gpu_blocks=None, max_num_seqs=4)
    # Sized from free memory, but never past what max_num_seqs sequences could use.
    assert 16 <= automatic.scheduler.kv_cache.pool.num_blocks <= 5 * 16
    with pytest.raises(ValueError, match="max_model_len"):
        make_engine(path, num_gpu_blocks=None, kv_cache_memory=3 * bytes_per_block)


def test_prompt_logprobs_survive_preemption_once_each(tiny_model_dir: Callable[[str], str]) -> None:
    path = tiny_model_dir("llama")
    prompts = [[(7 * i + j) % 500 + 3 for j in range(13 + 5 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    plain = LLM(path, dtype="float32", max_model_len=48, block_size=4).generate(prompts, params)
    tight = LLM(path, dtype="float32", max_model_len=48, block_size=4, num_gpu_blocks=12, max_num_batched_tokens=8)
    squeezed = tight.generate(prompts, params)
    assert tight.engine.stats().num_preemptions > 0
    for a, b in zip(plain, squeezed):
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for expected, got in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert got.keys() == expected.keys()
            for token_id, logprob in got.items():
                assert logprob.logprob == pytest.approx(expected[token_id].logprob, abs=1e-4)


def test_stop_strings_wait_for_min_tokens_and_stop_tokens_leave_no_text(tiny_model_dir: Callable[[str], str]) -> None:
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64)
    prompt = "Paris is the capital"
    plain = llm.generate(prompt, greedy(max_tokens=12))[0].outputs[0]
    tokenizer = llm.get_tokenizer()
    early = tokenizer.decode(plain.token_ids[:1])
    assert early.strip()
    cut = llm.generate(prompt, greedy(max_tokens=12, stop=[early.strip()]))[0].outputs[0]
    assert len(cut.token_ids) <= 2 and cut.finish_reason == "stop"
    held = llm.generate(prompt, greedy(max_tokens=12, min_tokens=6, stop=[early.strip()]))[0].outputs[0]
    assert len(held.token_ids) >= 6
    by_token = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[plain.token_ids[3]]))
    out = by_token[0].outputs[0]
    assert out.token_ids == plain.token_ids[:4] and out.stop_reason == plain.token_ids[3]
    # An incomplete UTF-8 character at the very end is held back, as in streaming.
    assert out.text == tokenizer.decode(plain.token_ids[:3]).rstrip("\ufffd")


def test_request_ids_cannot_collide_with_sequence_names(tiny_model_dir: Callable[[str], str]) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    engine.add_request(EngineCoreRequest("x", PROMPT, greedy(n=2, max_tokens=4)))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request(EngineCoreRequest("x#1", PROMPT, greedy(max_tokens=4)))
    indices: dict[int, list[int]] = {0: [], 1: []}
    finished = set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id == "x"
            indices[out.index].extend(out.new_token_ids)
            if out.finished:
                finished.add(out.index)
    assert finished == {0, 1} and len(indices[0]) == len(indices[1]) == 4


def test_prompts_in_every_accepted_form_give_the_same_tokens(tiny_model_dir: Callable[[str], str]) -> None:
    llm = LLM(tiny_model_dir("llama"), dtype="float32", max_model_len=64)
    text = "Paris is the capital"
    ids = llm.get_tokenizer().encode(text)
    forms = [text, ids, {"prompt": text}, {"prompt_token_ids": ids}]
    outputs = llm.generate(forms, greedy(max_tokens=6))
    assert all(o.prompt_token_ids == ids for o in outputs)
    assert len({tuple(o.outputs[0].token_ids) for o in outputs}) == 1
    assert [o.prompt for o in outputs] == [text, None, text, None]
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": text}, greedy(MAX_TOKENS))


def test_extreme_sampling_values_never_crash_the_engine(tiny_model_dir: Callable[[str], str]) -> None:
    """Values the server lets through must sample something, never raise inside a step."""
    engine = make_engine(tiny_model_dir("llama"))
    extremes = {
        "tiny_top_p": SamplingParams(top_p=1e-300, max_tokens=4, ignore_eos=True),
        "tiny_temperature": SamplingParams(temperature=1e-320, top_p=0.9, max_tokens=4, ignore_eos=True),
        "huge_top_k": SamplingParams(top_k=2**63 - 1, max_tokens=4, ignore_eos=True),
        "huge_seed": SamplingParams(seed=2**64 - 1, n=2, max_tokens=4, ignore_eos=True),
        "stop_id_with_min_tokens": SamplingParams(stop_token_ids=[511], min_tokens=2, max_tokens=4, ignore_eos=True),
    }
    for name, params in extremes.items():
        engine.add_request(EngineCoreRequest(name, PROMPT, params))
    counts: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = counts.get(out.request_id, 0) + len(out.new_token_ids)
    assert counts == {
        "tiny_top_p": 4,
        "tiny_temperature": 4,
        "huge_top_k": 4,
        "huge_seed": 8,
        "stop_id_with_min_tokens": 4,
    }
    engine.scheduler.check_integrity()
    # A temperature too small to divide by is greedy, not NaN sampling.
    (out,) = LLM(tiny_model_dir("llama")).generate([PROMPT], SamplingParams(temperature=1e-9, max_tokens=6))
    (ref,) = LLM(tiny_model_dir("llama")).generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=6))
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids


def test_stop_token_ids_outside_the_vocabulary_are_refused(tiny_model_dir: Callable[[str], str]) -> None:
    engine = make_engine(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(EngineCoreRequest("bad", PROMPT, SamplingParams(stop_token_ids=[512], min_tokens=1)))
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[2**64])
    assert not engine.has_unfinished_requests()


def test_stats_count_the_steps_that_computed_prompt_chunks(tiny_model_dir: Callable[[str], str]) -> None:
    """A router sizes local prompt chunks from these: steps in which a sequence computed
    more than one token, their seconds, and the tokens beyond one per sequence."""
    engine = make_engine(tiny_model_dir("llama"))
    engine.add_request(EngineCoreRequest("streaming", PROMPT[:3], greedy(max_tokens=8)))
    engine.step()  # the 3-token prompt: 2 tokens beyond one
    engine.step()  # a plain decode step
    engine.add_request(EngineCoreRequest("arriving", PROMPT, greedy(max_tokens=2)))
    engine.step()  # a decode token beside a 7-token prompt: 6 beyond one each
    stats = engine.stats()
    assert (stats.num_steps, stats.num_chunk_steps, stats.num_chunk_tokens) == (3, 2, 8)
    assert 0 < stats.chunk_step_seconds < stats.busy_seconds
