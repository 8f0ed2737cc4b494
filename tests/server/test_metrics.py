"""/metrics against ground truth: counters equal the usage the clients were told,
histogram counts equal the requests sent, rejections and aborts are counted, and the
gauges return to idle. The server runs with `--metrics-prefix vllm`, as a user of vLLM's
dashboards would; the in-process test checks that both prefixes serve the same values."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from prometheus_client.parser import text_string_to_metric_families

from cadence.engine.histogram import Histogram
from cadence.engine.protocol import EngineCoreOutput, StepStats
from cadence.server.engine_client import AsyncEngineClient
from cadence.server.metric_series import buckets_1_2_5
from cadence.server.metrics import build_registry, render
from tests.support.server_harness import ServerProcess

MODEL = "tiny"
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def samples(text: str, prefix: str = "vllm:") -> Samples:
    """Every sample of a /metrics body whose name has `prefix`, model_name dropped from the labels."""
    found: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.startswith(prefix):
                continue
            assert sample.labels.pop("model_name") == MODEL
            found[(sample.name.removeprefix(prefix), tuple(sorted(sample.labels.items())))] = sample.value
    return found


def value(found: Samples, name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    return value(after, name, **labels) - value(before, name, **labels)


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[[str], str]) -> Iterator[ServerProcess]:
    args = ("--served-model-name", MODEL, "--metrics-prefix", "vllm", "--block-size", "4")
    limits = ("--num-gpu-blocks", "256", "--max-num-seqs", "2", "--max-waiting", "0")
    with ServerProcess(tiny_model_dir("llama"), *args, *limits) as process:
        yield process


def scrape(server: ServerProcess) -> Samples:
    return samples(httpx.get(f"{server.base_url}/metrics", timeout=10).text)


def wait_idle(server: ServerProcess) -> Samples:
    """The metrics once no sequence runs, waits or holds a KV block (fails after 20 s)."""
    for _ in range(200):
        found = scrape(server)
        if not any(value(found, name) for name in ("num_requests_running", "num_requests_waiting")):
            if value(found, "kv_cache_usage_perc") == 0:
                return found
        time.sleep(0.1)
    raise AssertionError(f"the gauges never returned to idle: {found}")


def test_counters_and_histograms_match_what_clients_got(server: ServerProcess) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    before = wait_idle(server)
    prompts = [[5, 6, 7], list(range(10, 40)), list(range(10, 40)), [9] * 17]  # the third hits the second's prefix
    usages: list[CompletionUsage] = []
    for prompt in prompts:
        completion = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
        assert completion.usage is not None
        usages.append(completion.usage)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    usages.append([chunk.usage for chunk in stream if chunk.usage is not None][-1])
    after = wait_idle(server)
    requests = len(usages)
    prompt_tokens = sum(u.prompt_tokens for u in usages)
    generated = sum(u.completion_tokens for u in usages)
    assert delta(after, before, "prompt_tokens_total") == prompt_tokens
    assert delta(after, before, "generation_tokens_total") == generated
    finished = sum(delta(after, before, "request_success_total", finished_reason=r) for r in ("stop", "length"))
    assert finished == requests
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_queue_time_seconds",
        "request_prefill_time_seconds",
        "request_decode_time_seconds",
        "request_inference_time_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
        "request_params_n",
        "request_params_max_tokens",
    ):
        assert delta(after, before, f"{histogram}_count") == requests, histogram
    assert delta(after, before, "request_prompt_tokens_sum") == prompt_tokens
    assert delta(after, before, "request_generation_tokens_sum") == generated
    assert delta(after, before, "request_params_max_tokens_sum") == 6 * len(prompts) + 5
    assert delta(after, before, "inter_token_latency_seconds_count") == generated - requests
    assert value(after, "time_to_first_token_seconds_bucket", le="+Inf") == value(
        after, "time_to_first_token_seconds_count"
    )
    # A decode takes longer than nothing; the engine's phases add up to its inference time.
    phases = sum(delta(after, before, f"request_{p}_time_seconds_sum") for p in ("prefill", "decode"))
    assert phases == pytest.approx(delta(after, before, "request_inference_time_seconds_sum"), rel=1e-6)
    # Every step with tokens is in the iteration histogram and in exactly one kind.
    steps = delta(after, before, "iteration_tokens_total_count")
    kinds = [delta(after, before, "engine_step_seconds_count", kind=k) for k in ("prefill", "decode", "mixed")]
    assert steps >= generated and sum(kinds) == steps and kinds[0] > 0 and kinds[1] > 0
    # Tokens through the model: the prompts less the cache hit, and every output token but the last.
    assert delta(after, before, "iteration_tokens_total_sum") == prompt_tokens - 28 + generated - requests
    # Prefix cache: every first admission looked its prompt up; the repeated prompt found 28 of its 30 tokens
    # (whole 4-token blocks, the last token always computed).
    assert delta(after, before, "prefix_cache_queries_total") == prompt_tokens
    assert delta(after, before, "prefix_cache_hits_total") == 28
    assert (
        value(
            after,
            "cache_config_info",
            block_size="4",
            cache_dtype="auto",
            enable_prefix_caching="True",
            num_gpu_blocks="256",
        )
        == 1
    )


async def _overload_and_abort(base_url: str) -> tuple[int, int]:
    """Four long streams at once on a server that takes two sequences: the others get
    429; the two admitted are cut off after their first chunk. (admitted, refused)"""
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 50, "ignore_eos": True, "stream": True}
    statuses = []
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as http:

        async def one() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                statuses.append(response.status_code)
                if response.status_code == 200:
                    async for _ in response.aiter_lines():
                        break  # the first event, then hang up

        await asyncio.gather(*(one() for _ in range(4)))
    return statuses.count(200), statuses.count(429)


def test_rejections_and_aborts_are_counted_and_everything_returns_to_idle(server: ServerProcess) -> None:
    before = wait_idle(server)
    admitted, refused = asyncio.run(_overload_and_abort(server.base_url))
    assert refused >= 1 and admitted + refused == 4
    after = wait_idle(server)
    assert delta(after, before, "admission_rejections_total", reason="full") == refused
    assert delta(after, before, "request_success_total", finished_reason="abort") == admitted
    assert delta(after, before, "e2e_request_latency_seconds_count") == admitted
    assert delta(after, before, "time_to_first_token_seconds_count") == admitted


def test_both_prefixes_serve_the_same_values() -> None:
    client = AsyncEngineClient(max_waiting=1)
    metrics = client.metrics
    metrics.max_model_len = 64
    metrics.step(StepStats("prefill", 0.02, 10.0, 3, 1, prefix_cache_queries=3))
    metrics.admitted("r", 3, 1, 4)
    metrics.tokens(EngineCoreOutput("r", 0, [7], queued_at=9.0, scheduled_at=9.5), 10.0, now=1e9)
    metrics.tokens(EngineCoreOutput("r", 0, [8]), 10.1, now=1e9 + 0.05)
    metrics.request_finished("r", 1, "abort")
    cadence = samples(render(build_registry(client, MODEL, "cadence")).decode(), "cadence:")
    vllm = samples(render(build_registry(client, MODEL, "vllm")).decode(), "vllm:")
    assert cadence == vllm and value(vllm, "request_queue_time_seconds_sum") == 0.5
    assert value(vllm, "engine_step_batch_size_count", kind="prefill") == 1
    with pytest.raises(ValueError, match="prefix"):
        build_registry(client, MODEL, "sglang")


def test_histogram_buckets_are_vllms() -> None:
    assert buckets_1_2_5(64) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
    histogram = Histogram((1.0, 2.0))
    for observed in (0.5, 1.0, 1.5, 7.0):
        histogram.observe(observed)
    assert histogram.cumulative() == [("1.0", 2), ("2.0", 3), ("+Inf", 4)] and histogram.total == 10.0
