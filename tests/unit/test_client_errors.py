"""cadence.client against other OpenAI-compatible servers' answers (httpx.MockTransport):
vLLM's error bodies, whose `code` is the HTTP status, and answers of the wrong shape."""

from __future__ import annotations

import json

import httpx
import pytest

from cadence.client import BadRequestError, CadenceError, Client

BASE = "http://other.test"
# vLLM's error body: `code` is the status, an integer, and `type` its exception's name.
VLLM_ERROR = {"error": {"message": "max_tokens must be at least 1", "type": "BadRequestError", "code": 400}}


def client_of(answer: httpx.Response) -> Client:
    return Client(BASE, transport=httpx.MockTransport(lambda request: answer), max_retries=0)


def test_a_vllm_error_body_is_read() -> None:
    with pytest.raises(BadRequestError) as caught:
        client_of(httpx.Response(400, json=VLLM_ERROR)).completions("x", model="m", max_tokens=0)
    assert caught.value.body is not None and caught.value.code == 400
    assert caught.value.message == "max_tokens must be at least 1"


def test_a_vllm_error_event_in_a_stream_raises_the_class_of_its_code() -> None:
    body = f"data: {json.dumps(VLLM_ERROR)}\n\ndata: [DONE]\n\n".encode()
    answer = httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})
    with pytest.raises(BadRequestError, match="at least 1"):
        list(client_of(answer).completions_stream("x", model="m"))


def test_an_answer_of_the_wrong_shape_is_a_cadence_error() -> None:
    with pytest.raises(CadenceError, match="not a CompletionResponse"):
        client_of(httpx.Response(200, json={"unexpected": True})).completions("x", model="m")
    with pytest.raises(CadenceError, match="not a ModelList"):
        client_of(httpx.Response(200, json={"data": [{"id": 1}]})).completions("x")
