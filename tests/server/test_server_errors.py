"""Refusals of `cadence serve`, end to end against one real server process.

Every refusal must leave as OpenAI's `{"error": {message, type, param, code}}` with the
status the SDKs map to the right exception, and must leave the server serving with its
KV cache empty. The server (`strict`) has a small context, an API key and a small body
limit, for the 400, 401, 404 and 413 cases. Load, disconnects, engine death and
shutdown are in test_server_load.py.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_checks import (
    API_KEY,
    AUTH,
    BODY_LIMIT,
    CHAT,
    CMPL,
    MESSAGES,
    MODEL,
    STRICT_MAX_MODEL_LEN,
    VOCAB_SIZE,
    assert_error,
    assert_idle,
    assert_serves,
    post,
)
from tests.support.server_harness import ServerProcess


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


# One request's most sequences and generated tokens (n x max_tokens) on the strict server.
STRICT_MAX_N = 8
STRICT_MAX_OUTPUT = 2 * STRICT_MAX_MODEL_LEN


@pytest.fixture(scope="module")
def strict(model_dir: str) -> Iterator[ServerProcess]:
    with ServerProcess(
        model_dir,
        "--served-model-name",
        MODEL,
        "--max-model-len",
        str(STRICT_MAX_MODEL_LEN),
        "--api-key",
        API_KEY,
        "--max-request-body-bytes",
        "4KiB",
        "--max-n-sequences",
        str(STRICT_MAX_N),
        "--max-request-output-tokens",
        str(STRICT_MAX_OUTPUT),
    ) as server:
        yield server


# ----- 400 --------------------------------------------------------------------------------
LONG_TEXT = "Paris is the capital of France, and Berlin is the capital of Germany. " * 8

BAD_REQUESTS = [
    # (id, path, body, expected param; ... = not checked)
    ("cmpl-missing-prompt", CMPL, {"model": MODEL, "max_tokens": 4}, "prompt"),
    ("chat-missing-messages", CHAT, {"model": MODEL}, "messages"),
    ("chat-empty-messages", CHAT, {"model": MODEL, "messages": []}, "messages"),
    ("cmpl-body-not-object", CMPL, ["hello"], None),
    ("cmpl-n-string", CMPL, {"model": MODEL, "prompt": "hi", "n": "many"}, "n"),
    ("cmpl-max-tokens-string", CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
    ("cmpl-prompt-number", CMPL, {"model": MODEL, "prompt": 5}, "prompt"),
    ("chat-messages-string", CHAT, {"model": MODEL, "messages": "hello"}, "messages"),
    ("chat-bad-role", CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
    ("cmpl-stream-not-bool", CMPL, {"model": MODEL, "prompt": "hi", "stream": "sometimes"}, "stream"),
    ("cmpl-n-0", CMPL, {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ("chat-n-0", CHAT, {"model": MODEL, "messages": MESSAGES, "n": 0}, "n"),
    ("cmpl-n-over-max", CMPL, {"model": MODEL, "prompt": "hi", "n": STRICT_MAX_N + 1}, "n"),
    ("chat-n-over-max", CHAT, {"model": MODEL, "messages": MESSAGES, "n": STRICT_MAX_N + 1}, "n"),
    (
        "cmpl-n-times-max-tokens-over-max",
        CMPL,
        {"model": MODEL, "prompt": "hi", "n": STRICT_MAX_N, "max_tokens": STRICT_MAX_OUTPUT // STRICT_MAX_N + 1},
        "max_tokens",
    ),
    (
        "cmpl-prompts-times-n-times-max-tokens-over-max",
        CMPL,
        {"model": MODEL, "prompt": ["hi", "there"], "n": 4, "max_tokens": STRICT_MAX_OUTPUT // 8 + 1},
        "max_tokens",
    ),
    (
        "chat-n-times-max-completion-tokens-over-max",
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "n": 2, "max_completion_tokens": STRICT_MAX_OUTPUT // 2 + 1},
        "max_completion_tokens",
    ),
    ("cmpl-max-tokens-0", CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("cmpl-negative-temperature", CMPL, {"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("chat-negative-temperature", CHAT, {"model": MODEL, "messages": MESSAGES, "temperature": -1}, "temperature"),
    ("cmpl-top-p-0", CMPL, {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("chat-top-p-0", CHAT, {"model": MODEL, "messages": MESSAGES, "top_p": 0.0}, "top_p"),
    ("cmpl-logprobs-21", CMPL, {"model": MODEL, "prompt": "hi", "logprobs": 21}, "logprobs"),
    (
        "chat-top-logprobs-21",
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
    ),
    ("cmpl-empty-stop-in-list", CMPL, {"model": MODEL, "prompt": "hi", "stop": ["ok", ""]}, ...),
    ("cmpl-empty-stop-string", CMPL, {"model": MODEL, "prompt": "hi", "stop": ""}, ...),
    ("chat-empty-stop-string", CHAT, {"model": MODEL, "messages": MESSAGES, "stop": [""]}, ...),
    ("cmpl-logit-bias-outside-vocab", CMPL, {"model": MODEL, "prompt": "hi", "logit_bias": {"512": 10}}, "logit_bias"),
    # Integers msgpack cannot carry, or the sampler cannot hold, stop at the edge.
    ("cmpl-priority-over-int64", CMPL, {"model": MODEL, "prompt": "hi", "priority": 2**64}, "priority"),
    ("chat-priority-under-int64", CHAT, {"model": MODEL, "messages": MESSAGES, "priority": -(2**63) - 1}, "priority"),
    ("cmpl-top-k-over-int64", CMPL, {"model": MODEL, "prompt": "hi", "top_k": 2**63}, "top_k"),
    ("cmpl-stop-id-over-int64", CMPL, {"model": MODEL, "prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids.0"),
    (
        "cmpl-stop-id-outside-vocab",
        CMPL,
        {"model": MODEL, "prompt": "hi", "stop_token_ids": [VOCAB_SIZE]},
        "stop_token_ids",
    ),
    ("chat-too-many-stops", CHAT, {"model": MODEL, "messages": MESSAGES, "stop": ["x"] * 65}, "stop"),
    ("cmpl-stop-too-long", CMPL, {"model": MODEL, "prompt": "hi", "stop": "x" * 513}, "stop"),
    ("chat-stop-too-long", CHAT, {"model": MODEL, "messages": MESSAGES, "stop": ["ok", "x" * 513]}, "stop.1"),
    ("chat-logit-bias-over-100", CHAT, {"model": MODEL, "messages": MESSAGES, "logit_bias": {"5": -101}}, "logit_bias"),
    (
        # This server has no --enable-auto-tool-choice: tools default to "auto", refused as vLLM does.
        "chat-tools-auto-without-parser",
        CHAT,
        {
            "model": MODEL,
            "messages": MESSAGES,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        },
        "tool_choice",
    ),
    (
        "chat-image-part",
        CHAT,
        {
            "model": MODEL,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ],
        },
        "messages",
    ),
    ("cmpl-token-id-vocab", CMPL, {"model": MODEL, "prompt": [1, 5, VOCAB_SIZE]}, "prompt"),
    ("cmpl-token-id-vocab-batch", CMPL, {"model": MODEL, "prompt": [[1, 5], [7, 100000]]}, "prompt"),
    ("cmpl-token-id-negative", CMPL, {"model": MODEL, "prompt": [1, -3]}, "prompt"),
    ("cmpl-min-tokens-over-max", CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 4, "min_tokens": 8}, ...),
    (
        "chat-min-tokens-over-max",
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "max_tokens": 2, "min_tokens": 3},
        ...,
    ),
    (
        "cmpl-stream-options-without-stream",
        CMPL,
        {"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": True}},
        ...,
    ),
    (
        "chat-stream-options-without-stream",
        CHAT,
        {"model": MODEL, "messages": MESSAGES, "stream": False, "stream_options": {"include_usage": True}},
        ...,
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "param"), [case[1:] for case in BAD_REQUESTS], ids=[case[0] for case in BAD_REQUESTS]
)
def test_bad_request(strict: ServerProcess, path: str, body: Any, param: Any) -> None:
    assert_error(post(strict, path, body), 400, type="invalid_request_error", param=param)


def test_bad_request_streaming_is_refused_before_the_stream(strict: ServerProcess) -> None:
    """A streaming request that fails validation gets a plain 400, not an event stream."""
    response = post(strict, CMPL, {"model": MODEL, "prompt": "hi", "stream": True, "temperature": -1})
    assert_error(response, 400, type="invalid_request_error", param="temperature")
    response = post(strict, CHAT, {"model": MODEL, "messages": MESSAGES, "stream": True, "top_p": 0})
    assert_error(response, 400, type="invalid_request_error", param="top_p")


def test_malformed_json(strict: ServerProcess) -> None:
    for path in (CMPL, CHAT):
        response = httpx.post(
            f"{strict.base_url}{path}",
            content=b'{"model": "tiny", "prompt": "hi",',
            headers={**AUTH, "Content-Type": "application/json"},
            timeout=30,
        )
        # The error is in no field: param is null, not the parser's byte offset.
        error = assert_error(response, 400, type="invalid_request_error", param=None)
        assert "json" in error["message"].lower(), error


def test_prompt_longer_than_context(strict: ServerProcess) -> None:
    too_long_ids = [5] * STRICT_MAX_MODEL_LEN
    response = post(strict, CMPL, {"model": MODEL, "prompt": too_long_ids})
    error = assert_error(response, 400, type="invalid_request_error", param="prompt", code="context_length_exceeded")
    assert str(STRICT_MAX_MODEL_LEN) in error["message"]

    response = post(strict, CMPL, {"model": MODEL, "prompt": LONG_TEXT})
    assert_error(response, 400, type="invalid_request_error", param="prompt", code="context_length_exceeded")

    response = post(strict, CHAT, {"model": MODEL, "messages": [{"role": "user", "content": LONG_TEXT}]})
    assert_error(response, 400, type="invalid_request_error", param="messages", code="context_length_exceeded")


def test_prompt_plus_max_tokens_over_context(strict: ServerProcess) -> None:
    prompt = [5] * 10
    response = post(strict, CMPL, {"model": MODEL, "prompt": prompt, "max_tokens": STRICT_MAX_MODEL_LEN - 9})
    error = assert_error(
        response, 400, type="invalid_request_error", param="max_tokens", code="context_length_exceeded"
    )
    assert str(STRICT_MAX_MODEL_LEN) in error["message"]
    # Exactly filling the context is allowed.
    response = post(
        strict, CMPL, {"model": MODEL, "prompt": prompt, "max_tokens": STRICT_MAX_MODEL_LEN - 10, "ignore_eos": True}
    )
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == STRICT_MAX_MODEL_LEN - 10

    response = post(strict, CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": STRICT_MAX_MODEL_LEN})
    assert_error(response, 400, type="invalid_request_error", param="max_tokens", code="context_length_exceeded")
    response = post(strict, CHAT, {"model": MODEL, "messages": MESSAGES, "max_completion_tokens": STRICT_MAX_MODEL_LEN})
    assert_error(
        response, 400, type="invalid_request_error", param="max_completion_tokens", code="context_length_exceeded"
    )


def test_request_size_limits_with_the_openai_sdk(strict: ServerProcess) -> None:
    """Past --max-n-sequences or --max-request-output-tokens the SDK raises BadRequestError
    naming the field; at them the request is served, and a request that names no
    max_tokens gets its share of the tokens."""
    client = openai.OpenAI(base_url=f"{strict.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt="hi", n=STRICT_MAX_N + 1, max_tokens=1)
    assert caught.value.param == "n" and str(STRICT_MAX_N) in caught.value.message
    per_sequence = STRICT_MAX_OUTPUT // STRICT_MAX_N
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL, messages=MESSAGES, n=STRICT_MAX_N, max_completion_tokens=per_sequence + 1
        )
    assert caught.value.param == "max_completion_tokens" and str(STRICT_MAX_OUTPUT) in caught.value.message
    ignore_eos = {"ignore_eos": True}
    served = client.completions.create(
        model=MODEL, prompt="hi", n=STRICT_MAX_N, max_tokens=per_sequence, extra_body=ignore_eos
    )
    assert served.usage is not None and served.usage.completion_tokens == STRICT_MAX_OUTPUT
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=STRICT_MAX_N, extra_body=ignore_eos)
    assert chat.usage is not None and chat.usage.completion_tokens == STRICT_MAX_OUTPUT
    assert {choice.finish_reason for choice in chat.choices} == {"length"}


def test_unknown_fields_are_ignored(strict: ServerProcess) -> None:
    response = post(
        strict,
        CMPL,
        {"model": MODEL, "prompt": "hi", "max_tokens": 3, "frobnicate": True, "vendor_ext": {"a": [1, 2]}},
    )
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "text_completion"
    response = post(
        strict,
        CHAT,
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi", "x_custom": 1}],
            "max_tokens": 3,
            "unknown_option": "yes",
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["object"] == "chat.completion"


def test_null_means_unset(strict: ServerProcess) -> None:
    """OpenAI's schema allows null for optional fields, and some clients send it."""
    nulls = {"n": None, "stream": None, "echo": None, "ignore_eos": None, "min_tokens": None, "priority": None}
    response = post(
        strict, CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stop": None, "seed": None, **nulls}
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 1
    chat = post(strict, CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 3, "logprobs": None, **nulls})
    assert chat.status_code == 200, chat.text


# ----- 401 --------------------------------------------------------------------------------
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", CMPL, {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("POST", CHAT, {"model": MODEL, "messages": MESSAGES, "max_tokens": 2}),
    ("POST", "/tokenize", {"prompt": "hi"}),
]


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED, ids=[p[1] for p in PROTECTED])
def test_api_key_is_required(strict: ServerProcess, method: str, path: str, body: Any) -> None:
    url = f"{strict.base_url}{path}"
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": API_KEY},  # no scheme
        {"Authorization": f"Basic {API_KEY}"},
        {b"Authorization": "Bearer caf\u00e9".encode()},  # not ASCII: still a 401, not a 500
    ):
        response = httpx.request(method, url, json=body, headers=headers, timeout=30)
        assert_error(response, 401, type="authentication_error", code="invalid_api_key")
    response = httpx.request(method, url, json=body, headers=AUTH, timeout=30)
    assert response.status_code == 200, response.text


def test_open_routes_need_no_key(strict: ServerProcess) -> None:
    for path in ("/health", "/version", "/metrics"):
        response = httpx.get(f"{strict.base_url}{path}", timeout=30)
        assert response.status_code == 200, (path, response.text)
    assert "cadence:num_requests_running" in httpx.get(f"{strict.base_url}/metrics", timeout=30).text


def test_openai_sdk_wrong_key(strict: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{strict.base_url}/v1", api_key="wrong", max_retries=0, timeout=30)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    assert caught.value.status_code == 401
    assert caught.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    good = openai.OpenAI(base_url=f"{strict.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    assert [m.id for m in good.models.list()] == [MODEL]


# ----- 404 and 405 ------------------------------------------------------------------------
def test_unknown_model(strict: ServerProcess) -> None:
    for path, body in ((CMPL, {"prompt": "hi"}), (CHAT, {"messages": MESSAGES})):
        response = post(strict, path, {**body, "model": "no-such-model"})
        error = assert_error(response, 404, type="not_found_error", param="model", code="model_not_found")
        assert "no-such-model" in error["message"]
    client = openai.OpenAI(base_url=f"{strict.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=30)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_unknown_route_and_method(strict: ServerProcess) -> None:
    assert_error(httpx.get(f"{strict.base_url}/v1/nothing-here", headers=AUTH, timeout=30), 404, type="not_found_error")
    assert_error(httpx.get(f"{strict.base_url}/nothing-here", timeout=30), 404, type="not_found_error")
    assert_error(httpx.post(f"{strict.base_url}/v1/embeddings", json={}, headers=AUTH, timeout=30), 404)
    response = httpx.get(f"{strict.base_url}{CMPL}", headers=AUTH, timeout=30)
    assert_error(response, 405)


# ----- 413 --------------------------------------------------------------------------------
def _big_body() -> bytes:
    return json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "padding": "x" * (4 * BODY_LIMIT)}).encode()


def test_body_too_large_with_content_length(strict: ServerProcess) -> None:
    body = _big_body()
    for path in (CMPL, CHAT):
        response = httpx.post(
            f"{strict.base_url}{path}", content=body, headers={**AUTH, "Content-Type": "application/json"}, timeout=30
        )
        assert response.request.headers["content-length"] == str(len(body))
        assert_error(response, 413, code="request_too_large")


def test_body_too_large_chunked(strict: ServerProcess) -> None:
    body = _big_body()

    def chunks() -> Iterator[bytes]:
        for start in range(0, len(body), 1024):
            yield body[start : start + 1024]

    response = httpx.post(
        f"{strict.base_url}{CMPL}", content=chunks(), headers={**AUTH, "Content-Type": "application/json"}, timeout=30
    )
    assert "content-length" not in response.request.headers
    assert response.request.headers["transfer-encoding"] == "chunked"
    assert_error(response, 413, code="request_too_large")


def test_body_under_limit_chunked_is_served(strict: ServerProcess) -> None:
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, "padding": "x" * (BODY_LIMIT // 2)}).encode()
    response = httpx.post(
        f"{strict.base_url}{CMPL}",
        content=iter([body[:100], body[100:]]),
        headers={**AUTH, "Content-Type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 200, response.text


def test_strict_server_still_serves_and_is_idle(strict: ServerProcess) -> None:
    assert_serves(strict, AUTH)
    assert_idle(strict)
