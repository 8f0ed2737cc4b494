"""End to end: `cadence serve` on a tiny random model, spoken to with the openai SDK.

Raw JSON is validated strictly with the SDK's own pydantic models; greedy answers are
compared with the offline `LLM` on the same weights.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types import Completion, CompletionChoice, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from cadence import LLM, SamplingParams
from tests.support.server_harness import ServerProcess

MODEL_KIND = "llama"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir(MODEL_KIND)


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(model_dir, "--num-gpu-blocks", "512", "--served-model-name", "tiny") as process:
        yield process


@pytest.fixture(scope="module")
def offline(model_dir: str) -> LLM:
    return LLM(model_dir)


@pytest.fixture()
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def greedy_prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randrange(3, 40))] for _ in range(count)]


def offline_texts(offline: LLM, prompts: list[list[int]], max_tokens: int) -> list[str]:
    outputs = offline.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [o.outputs[0].text for o in outputs]


def sse_payloads(response: httpx.Response) -> list[dict | str]:
    """Every `data:` payload of an SSE body, checking the framing on the way."""
    text = response.text
    assert text.endswith("data: [DONE]\n\n")
    events = text.split("\n\n")
    assert events[-1] == ""
    payloads: list[dict | str] = []
    for event in events[:-1]:
        assert event.startswith("data: "), event
        data = event[len("data: ") :]
        payloads.append(data if data == "[DONE]" else json.loads(data))
    assert payloads.count("[DONE]") == 1
    return payloads


def test_models_version_health(server: ServerProcess, client: openai.OpenAI) -> None:
    listed = client.models.list().data
    assert [m.id for m in listed] == ["tiny"]
    raw = httpx.get(f"{server.base_url}/v1/models").json()
    Model.model_validate(raw["data"][0], strict=True)
    assert raw["data"][0]["max_model_len"] == 512
    assert httpx.get(f"{server.base_url}/health").status_code == 200
    assert httpx.get(f"{server.base_url}/version").json()["version"]


def test_completions_match_offline_greedy(server: ServerProcess, client: openai.OpenAI, offline: LLM) -> None:
    prompts = greedy_prompts(4)
    expected = offline_texts(offline, prompts, 12)
    response = client.completions.create(model="tiny", prompt=prompts, max_tokens=12, temperature=0)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == expected
    assert response.usage is not None
    assert response.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert response.usage.completion_tokens == 4 * 12
    assert all(c.finish_reason == "length" for c in response.choices)
    raw = httpx.post(
        f"{server.base_url}/v1/completions",
        json={"model": "tiny", "prompt": prompts[0], "max_tokens": 12, "temperature": 0},
    ).json()
    Completion.model_validate(raw, strict=True)
    assert raw["choices"][0]["text"] == expected[0]


def test_text_prompt_and_string_list(server: ServerProcess, client: openai.OpenAI, offline: LLM) -> None:
    texts = ["The quick brown fox", "Paris is the capital of"]
    ids = [offline.get_tokenizer().encode(t) for t in texts]
    expected = offline_texts(offline, ids, 8)
    response = client.completions.create(model="tiny", prompt=texts, max_tokens=8, temperature=0, n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [expected[0], expected[0], expected[1], expected[1]]


def test_chat_matches_offline_and_validates(server: ServerProcess, client: openai.OpenAI, offline: LLM) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]
    tokenizer = offline.get_tokenizer()
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    (expected,) = offline_texts(offline, [tokenizer.encode(prompt, add_special_tokens=False)], 10)
    raw = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_completion_tokens": 10, "temperature": 0},
    ).json()
    parsed = ChatCompletion.model_validate(raw, strict=True)
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == expected
    assert parsed.usage is not None and parsed.usage.completion_tokens == 10
    # Text parts are joined like plain content.
    parts: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Name a fox."}]},
    ]
    again = client.chat.completions.create(model="tiny", messages=parts, max_tokens=10, temperature=0)
    assert again.choices[0].message.content == expected


def _collect_chat_stream(server: ServerProcess, body: dict) -> tuple[dict[int, str], dict[int, list[str]], list[dict]]:
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = sse_payloads(response)
    chunks = [p for p in payloads if isinstance(p, dict)]
    texts: dict[int, str] = {}
    finishes: dict[int, list[str]] = {}
    for chunk in chunks:
        ChatCompletionChunk.model_validate(chunk, strict=True)
        for choice in chunk["choices"]:
            index = choice["index"]
            if index not in texts:
                assert choice["delta"]["role"] == "assistant", "the first delta of a choice carries the role"
                texts[index] = ""
            else:
                assert "role" not in choice["delta"]
            texts[index] += choice["delta"].get("content") or ""
            if choice["finish_reason"] is not None:
                finishes.setdefault(index, []).append(choice["finish_reason"])
    return texts, finishes, chunks


def test_chat_stream_equals_non_stream(server: ServerProcess, client: openai.OpenAI) -> None:
    body: dict[str, Any] = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Tell me about blocks."}],
        "max_tokens": 24,
        "temperature": 0,
        "n": 2,
    }
    whole = client.chat.completions.create(**body)
    texts, finishes, chunks = _collect_chat_stream(server, {**body, "stream_options": {"include_usage": True}})
    assert texts == {c.index: c.message.content for c in whole.choices}
    expected = {c.index: [c.finish_reason] for c in whole.choices}
    assert finishes == expected, "finish_reason appears exactly once per choice, as in the whole answer"
    usage_chunk = chunks[-1]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"] == whole.usage.model_dump(exclude_none=True)
    assert all(c["usage"] is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(server: ServerProcess, client: openai.OpenAI) -> None:
    prompts = greedy_prompts(2, seed=5)
    whole = client.completions.create(model="tiny", prompt=prompts, max_tokens=16, temperature=0)
    streamed: dict[int, str] = {}
    finishes: dict[int, int] = {}
    for chunk in client.completions.create(model="tiny", prompt=prompts, max_tokens=16, temperature=0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = finishes.get(choice.index, 0) + 1
                CompletionChoice.model_validate(choice.model_dump(), strict=True)
    assert streamed == {c.index: c.text for c in whole.choices}
    assert finishes == {0: 1, 1: 1}


def test_stop_string_is_never_streamed(server: ServerProcess, client: openai.OpenAI) -> None:
    prompt = greedy_prompts(1, seed=9)[0]
    full = client.completions.create(model="tiny", prompt=prompt, max_tokens=30, temperature=0).choices[0].text
    assert len(full) > 12, "the tiny model should say something to cut"
    stop = full[8:12]
    expected = full[: full.index(stop)]
    pieces = []
    finish = []
    for chunk in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=30, temperature=0, stop=[stop], stream=True
    ):
        for choice in chunk.choices:
            pieces.append(choice.text)
            if choice.finish_reason:
                finish.append((choice.finish_reason, choice.model_extra.get("stop_reason")))  # type: ignore[union-attr]
    assert "".join(pieces) == expected
    assert finish == [("stop", stop)]


def test_32_concurrent_async_requests_equal_offline(server: ServerProcess, offline: LLM) -> None:
    prompts = greedy_prompts(32, seed=3)
    expected = offline_texts(offline, prompts, 20)

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
        async with client:
            tasks = [client.completions.create(model="tiny", prompt=p, max_tokens=20, temperature=0) for p in prompts]
            responses = await asyncio.gather(*tasks)
        return [r.choices[0].text for r in responses]

    assert asyncio.run(run()) == expected


def test_chat_logprobs_match_offline(server: ServerProcess, client: openai.OpenAI, offline: LLM) -> None:
    messages: list[Any] = [{"role": "user", "content": "Count."}]
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3
    )
    logprobs = response.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert len(content) == 6
    tokenizer = offline.get_tokenizer()
    ids = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    (out,) = offline.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=3))
    for entry, token_id, position in zip(content, out.outputs[0].token_ids, out.outputs[0].logprobs):
        assert entry.logprob == pytest.approx(position[token_id].logprob, abs=1e-4)
        assert len(entry.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-6)
        assert entry.bytes == list(entry.token.encode("utf-8"))


def test_completion_echo_with_logprobs(server: ServerProcess, client: openai.OpenAI, offline: LLM) -> None:
    text = "The quick brown fox"
    response = client.completions.create(model="tiny", prompt=text, max_tokens=4, temperature=0, echo=True, logprobs=2)
    choice = response.choices[0]
    assert choice.text.startswith(text)
    prompt_len = len(offline.get_tokenizer().encode(text))
    lp = choice.logprobs
    assert lp is not None
    assert lp.tokens is not None and lp.text_offset is not None
    assert lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == prompt_len + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)


def test_seeded_sampling_is_reproducible(server: ServerProcess, client: openai.OpenAI) -> None:
    body: dict[str, Any] = dict(model="tiny", prompt="Paris is", max_tokens=12, temperature=1.0, seed=1234, n=2)
    first = client.completions.create(**body)
    second = client.completions.create(**body)
    assert [c.text for c in first.choices] == [c.text for c in second.choices]


def test_tokenize_and_detokenize(server: ServerProcess, offline: LLM) -> None:
    tokenizer = offline.get_tokenizer()
    text = "A paged KV cache"
    got = httpx.post(f"{server.base_url}/tokenize", json={"prompt": text}).json()
    assert got["tokens"] == tokenizer.encode(text)
    assert got["count"] == len(got["tokens"]) and got["max_model_len"] == 512
    messages = [{"role": "user", "content": "hi"}]
    chat = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tokenizer.encode(rendered, add_special_tokens=False)
    back = httpx.post(f"{server.base_url}/detokenize", json={"tokens": got["tokens"]}).json()
    assert back["prompt"] == text


def test_metrics_count_tokens(server: ServerProcess, client: openai.OpenAI) -> None:
    before = server.metric("cadence:generation_tokens_total")
    client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=5, temperature=0)
    assert server.metric("cadence:generation_tokens_total") == before + 5
    assert server.wait_for_metric("cadence:num_requests_running", 0) == 0
    assert server.wait_for_metric("cadence:kv_cache_usage_perc", 0) == 0


def test_continuous_usage_stats_grow_chunk_by_chunk(server: ServerProcess) -> None:
    body = {
        "model": "tiny",
        "prompt": [5, 6, 7],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    chunks = [
        p
        for p in sse_payloads(httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60))
        if isinstance(p, dict)
    ]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"]["prompt_tokens"] == 3 for c in chunks)
    assert counts == sorted(counts) and counts[-1] == 8
    assert chunks[-1]["choices"] == []


def test_offline_chat_answers_as_the_server_does(client: openai.OpenAI, offline: LLM) -> None:
    from tests.support.tool_chat_template import TOOL_CHAT_TEMPLATE

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]
    served = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    (output,) = offline.chat(messages, SamplingParams(max_tokens=8, temperature=0.0))
    assert output.outputs[0].text == served.choices[0].message.content
    # A list of conversations, each rendered with the tools and the template's own options.
    tool = {"type": "function", "function": {"name": "find_fox", "parameters": {"type": "object"}}}
    outputs = offline.chat(
        [messages, messages[1:]],
        SamplingParams(max_tokens=2),
        chat_template=TOOL_CHAT_TEMPLATE,
        tools=[tool],
        chat_template_kwargs={"enable_thinking": True},
    )
    assert len(outputs) == 2
    assert all("find_fox" in (o.prompt or "") and (o.prompt or "").endswith("<think>\n") for o in outputs)
