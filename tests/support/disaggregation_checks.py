"""Shared by the tests of disaggregated servers: a mixed burst of completions, the offline
colocated engine's greedy text for it, and waiting for an engine's state in /health."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from cadence import LLM, SamplingParams
from tests.support.server_checks import CMPL, MODEL
from tests.support.server_harness import ServerProcess

OPTIONS = {
    "dtype": "float32",
    "block_size": 4,
    "max_model_len": 256,
    "max_num_batched_tokens": 48,
    "num_gpu_blocks": 400,
}
FLAGS = [f"--{name.replace('_', '-')}={value}" for name, value in OPTIONS.items()]


def prompts(seed: int, count: int) -> list[tuple[list[int], int, int]]:
    """(prompt token ids, max_tokens, n) for a mixed burst."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(40)]
    return [
        (
            shared[: rng.choice([0, 8, 21, 40])] + [rng.randrange(1, 500) for _ in range(rng.choice([1, 5, 30, 120]))],
            rng.randrange(4, 12),
            2 if index % 7 == 3 else 1,
        )
        for index in range(count)
    ]


def offline_texts(model_dir: str, burst: list[tuple[list[int], int, int]]) -> list[list[str]]:
    llm = LLM(model_dir, **OPTIONS)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True, n=n) for _, m, n in burst]
    outputs = llm.generate([{"prompt_token_ids": p} for p, _, _ in burst], params)
    return [[c.text for c in output.outputs] for output in outputs]


def complete(server: ServerProcess, prompt: list[int], max_tokens: int, n: int) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "n": n, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{server.base_url}{CMPL}", json=body, timeout=120)


def burst_texts(
    server: ServerProcess, burst: list[tuple[list[int], int, int]], during: Callable[[], object] | None = None
) -> list[httpx.Response]:
    with ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(complete, server, *item) for item in burst]
        if during is not None:
            during()
        return [future.result() for future in futures]


def texts_of(response: httpx.Response) -> list[str]:
    assert response.status_code == 200, response.text
    return [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def wait_health(server: ServerProcess, engine: str, state: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        response = httpx.get(f"{server.base_url}/health", timeout=5)
        if response.status_code == 200 and response.json()["engines"].get(engine) == state:
            return
        time.sleep(0.2)
    raise AssertionError(f"{engine} did not become {state}: {server.log()}")
