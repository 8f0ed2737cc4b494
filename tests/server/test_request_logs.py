"""Structured logs and X-Request-Id: a client's id comes back on the response, names the
request in the per-request log line, and every line the server and its engine write is
one JSON object (`--log-format json`); prompt text is never logged unless asked for."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator

import httpx
import pytest

from cadence.engine.outputs import CompletionOutput, RequestOutput
from cadence.server.request_log import log_finished
from tests.support.server_harness import ServerProcess

MODEL = "tiny"
SECRET = "the prompt nobody may read"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str]) -> Iterator[ServerProcess]:
    args = ("--served-model-name", MODEL, "--log-format", "json", "--log-level", "info")
    with ServerProcess(tiny_model_dir("llama"), *args) as process:
        yield process


def complete(server: ServerProcess, headers: dict[str, str] | None = None, **body: object) -> httpx.Response:
    payload = {"model": MODEL, "prompt": SECRET, "max_tokens": 4, "temperature": 0, **body}
    return httpx.post(f"{server.base_url}/v1/completions", json=payload, headers=headers or {}, timeout=60)


def log_lines(server: ServerProcess) -> list[dict]:
    with open(server.log_path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]  # every line must be JSON


def finished_line(server: ServerProcess, request_id: str) -> dict:
    for _ in range(50):
        found = [line for line in log_lines(server) if line.get("request_id") == request_id]
        if found:
            return found[-1]
        time.sleep(0.1)
    raise AssertionError(f"no log line for {request_id}")


def test_a_clients_request_id_names_the_request_everywhere(server: ServerProcess) -> None:
    response = complete(server, {"X-Request-Id": "trace-42"})
    assert response.status_code == 200 and response.headers["x-request-id"] == "trace-42"
    assert response.json()["id"] == "cmpl-trace-42"
    usage = response.json()["usage"]
    line = finished_line(server, "cmpl-trace-42-0")
    assert line["logger"] == "cadence.requests" and line["level"] == "INFO"
    assert line["prompt_tokens"] == usage["prompt_tokens"]
    (sequence,) = line["sequences"]
    assert sequence["tokens"] == usage["completion_tokens"] and sequence["finish_reason"] == "length"
    assert 0 < sequence["ttft_s"] <= sequence["e2e_s"]
    # Without --log-prompts no text of the prompt or the answer is written anywhere.
    assert "prompt" not in line and "text" not in sequence
    with open(server.log_path, encoding="utf-8") as f:
        assert SECRET not in f.read()


def test_ids_are_made_when_absent_and_bad_ones_refused(server: ServerProcess) -> None:
    response = complete(server)
    made = response.headers["x-request-id"]
    assert len(made) == 32 and response.json()["id"] == f"cmpl-{made}"
    refused = complete(server, {"X-Request-Id": "has a space"})
    assert refused.status_code == 400 and "X-Request-Id" in refused.json()["error"]["message"]
    streamed = httpx.post(
        f"{server.base_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True},
        headers={"X-Request-Id": "chat-7"},
        timeout=60,
    )
    first_chunk = json.loads(streamed.text.split("\n", 1)[0].removeprefix("data: "))
    assert streamed.headers["x-request-id"] == "chat-7" and first_chunk["id"] == "chatcmpl-chat-7"
    assert finished_line(server, "chatcmpl-chat-7-0")["sequences"][0]["tokens"] == 2
    # Lines written while serving a request carry its id, uvicorn's access line among them.
    assert any(
        line["logger"].startswith("uvicorn") and line.get("request_id") == "chat-7" for line in log_lines(server)
    )


def test_log_prompts_adds_the_texts(caplog: pytest.LogCaptureFixture) -> None:
    summary = {
        "request_id": "cmpl-x-0",
        "prompt_tokens": 3,
        "sequences": [{"index": 0, "finish_reason": "stop", "tokens": 2, "ttft_s": None, "e2e_s": 0.5}],
    }
    output = RequestOutput("cmpl-x-0", SECRET, [1, 2, 3], [CompletionOutput(0, "an answer", [4, 5], None, None)])
    with caplog.at_level(logging.INFO, logger="cadence.requests"):
        log_finished(summary, output, log_prompts=False)
        log_finished(summary, output, log_prompts=True)
    quiet, loud = caplog.records
    assert SECRET not in quiet.getMessage() and "prompt" not in quiet.fields  # type: ignore[attr-defined]
    assert loud.fields["prompt"] == SECRET  # type: ignore[attr-defined]
    assert loud.fields["sequences"][0]["text"] == "an answer"  # type: ignore[attr-defined]


def test_an_id_in_use_is_refused_without_touching_the_request_that_has_it(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 40, "ignore_eos": True, "stream": True}
    body["stream_options"] = {"include_usage": True}
    headers = {"X-Request-Id": "twice"}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60) as first:
        lines = first.iter_lines()
        assert next(lines).startswith("data: ")
        second = complete(server, headers)
        assert second.status_code == 400 and "already in use" in second.json()["error"]["message"]
        events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    final = json.loads(events[-2].removeprefix("data: "))
    assert final["usage"]["completion_tokens"] == 40  # it ran to the end, untouched
