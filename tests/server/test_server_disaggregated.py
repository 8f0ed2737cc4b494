"""`cadence serve --prefill-workers 1 --decode-workers 1`, end to end.

Concurrent completions of mixed lengths (shared prefixes, chunked prompts, n > 1) must
give the offline colocated engine's greedy text. Killing the prefill engine mid-burst
costs no request (prompts are computed on the decode engine, then it is started again);
killing the decode engine fails its requests with 503 and the server serves again once
it is back.
"""

from __future__ import annotations

import glob
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.disaggregation_checks import (
    FLAGS,
    burst_texts,
    complete,
    offline_texts,
    prompts,
    texts_of,
    wait_health,
)
from tests.support.server_checks import MODEL, assert_error
from tests.support.server_harness import ServerProcess, pid_alive

pytestmark = pytest.mark.slow  # three engine processes start, and start again


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def server(model_dir: str) -> Iterator[ServerProcess]:
    before = set(glob.glob("/dev/shm/cadence-kv-*"))
    flags = ["--prefill-workers", "1", "--decode-workers", "1", "--prefill-placement", "remote", *FLAGS]
    flags += ["--served-model-name", MODEL]
    with ServerProcess(model_dir, *flags) as running:
        yield running
    # KV is shared through memfds, never named in /dev/shm (that they go with their
    # processes, killed or not, is test_server_disaggregated_crash.py's).
    assert set(glob.glob("/dev/shm/cadence-kv-*")) <= before, "KV files outlived their engines"


def test_disaggregated_server_gives_the_colocated_text(server: ServerProcess, model_dir: str) -> None:
    burst = prompts(0, 32)
    responses = burst_texts(server, burst)
    assert [texts_of(r) for r in responses] == offline_texts(model_dir, burst)
    health = httpx.get(f"{server.base_url}/health", timeout=5).json()
    assert health == {"engines": {"prefill-0": "serving", "decode-0": "serving"}}
    assert server.metric("cadence:num_requests_running") == 0.0
    # Most prompts moved; the transfers, their bytes and latencies and the ratio are exported.
    assert server.metric("cadence:prefills_total") == 32.0
    assert server.metric("cadence:kv_transfers_total") >= 20.0
    assert server.metric("cadence:kv_transfer_bytes_total") > 0.0
    assert server.metric("cadence:kv_transfer_seconds_count") == server.metric("cadence:kv_transfers_total")
    assert server.metric("cadence:recommended_prefill_decode_ratio") > 0.0
    assert server.metric("cadence:engine_queue") == 0.0


def test_a_dead_prefill_engine_costs_no_request(server: ServerProcess, model_dir: str) -> None:
    burst = prompts(1, 24)
    (prefill_pid,) = server.engine_pids("cadence-prefill")

    def kill() -> None:
        time.sleep(0.3)
        os.kill(prefill_pid, signal.SIGKILL)

    responses = burst_texts(server, burst, kill)
    assert [texts_of(r) for r in responses] == offline_texts(model_dir, burst)
    assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
    wait_health(server, "prefill-0", "serving")
    assert server.metric("cadence:engine_restarts_total") == 1.0
    burst = prompts(2, 8)
    assert [texts_of(r) for r in burst_texts(server, burst)] == offline_texts(model_dir, burst)


def test_a_dead_decode_engine_fails_its_requests_then_serves_again(server: ServerProcess) -> None:
    (decode_pid,) = server.engine_pids("cadence-decode")
    generated = server.metric("cadence:generation_tokens_total")
    with ThreadPoolExecutor(1) as pool:
        long = pool.submit(complete, server, list(range(1, 30)), 200, 1)
        # Killed once its tokens come from the decode engine: a fixed wait lost the race to
        # a fast machine, which generated all 200 first.
        deadline = time.monotonic() + 60
        while server.metric("cadence:generation_tokens_total") < generated + 2:
            assert not long.done() and time.monotonic() < deadline, "the request never reached decode"
            time.sleep(0.005)
        os.kill(decode_pid, signal.SIGKILL)
        assert_error(long.result(), 503, type="service_unavailable")
    wait_health(server, "decode-0", "serving")
    assert texts_of(complete(server, list(range(1, 30)), 4, 1))


def test_engines_outlast_a_sigterm_that_reaches_them(server: ServerProcess) -> None:
    """A process-group SIGTERM (a terminal, systemd) reaches the engines too: they leave
    stopping to the server, which drains first (then the fixture checks their files)."""
    pids = server.engine_pids("cadence-prefill") + server.engine_pids("cadence-decode")
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    time.sleep(0.5)
    assert all(pid_alive(pid) for pid in pids)
    assert texts_of(complete(server, list(range(1, 30)), 4, 1))
