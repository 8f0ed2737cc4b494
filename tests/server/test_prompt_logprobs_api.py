"""vLLM's prompt_logprobs on the server: on each completions choice and at the top of a
chat answer, equal to what the offline LLM computes for the same prompt."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion

from cadence import LLM, SamplingParams
from tests.support.server_checks import CHAT, CMPL, MESSAGES, MODEL, post
from tests.support.server_harness import ServerProcess

PROMPT = [5, 17, 230, 41, 9, 300]


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, "--num-gpu-blocks", "512", "--served-model-name", MODEL) as process:
        yield process


def test_completions_prompt_logprobs_match_offline(server: ServerProcess, model_dir: str) -> None:
    (offline,) = LLM(model_dir).generate([PROMPT], SamplingParams(max_tokens=1, prompt_logprobs=2))
    assert offline.prompt_logprobs is not None
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "n": 2, "prompt_logprobs": 2}
    raw = post(server, CMPL, body).json()
    Completion.model_validate(raw)
    for choice in raw["choices"]:
        served = choice["prompt_logprobs"]
        assert len(served) == len(PROMPT) and served[0] is None
        for token, position, expected in zip(PROMPT[1:], served[1:], offline.prompt_logprobs[1:]):
            assert expected is not None
            assert str(token) in position and len(position) <= 3
            for key, entry in position.items():
                reference = expected[int(key)]
                assert math.isclose(entry["logprob"], reference.logprob, rel_tol=1e-4, abs_tol=1e-4)
                assert entry["rank"] == reference.rank and entry["decoded_token"] == reference.decoded_token


def test_chat_prompt_logprobs_are_on_the_answer(server: ServerProcess) -> None:
    raw = post(server, CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0}).json()
    ChatCompletion.model_validate(raw)
    served = raw["prompt_logprobs"]
    assert len(served) == raw["usage"]["prompt_tokens"] and served[0] is None
    assert all(len(position) == 1 for position in served[1:])  # the prompt's own token, no alternatives
    assert "prompt_logprobs" not in raw["choices"][0]


def test_without_asking_there_are_none(server: ServerProcess) -> None:
    raw = post(server, CMPL, {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}).json()
    assert raw["choices"][0]["prompt_logprobs"] is None
