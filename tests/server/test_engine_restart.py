"""A dead engine is started again: what was in flight fails, the server comes back to 200
on /health, and nothing leaks; starts that keep failing end the server with status 1.
`--engine-restart never` (the engine stays dead) is in test_server_load.py."""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support.server_checks import (
    CMPL,
    MODEL,
    assert_error,
    assert_idle,
    assert_serves,
    kill_engine_mid_requests,
)
from tests.support.server_harness import ServerProcess, child_pids, pid_alive

# Each test starts engines two or three times over: 15 s or more.
pytestmark = pytest.mark.slow

RESTARTS = "cadence:engine_restarts_total"
STEPS = "cadence:engine_steps_total"


def _wait_healthy(server: ServerProcess, timeout: float) -> float:
    """Seconds until /health answers 200 again."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200:
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"no 200 on /health within {timeout} s:\n{server.log()}")


GREEDY = {"model": MODEL, "prompt": "Paris is the capital of", "max_tokens": 12, "temperature": 0.0}


def _greedy_text(server: ServerProcess) -> str:
    response = httpx.post(f"{server.base_url}{CMPL}", json=GREEDY, timeout=30)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def test_killed_engine_is_started_again_under_load(tiny_model_dir: Callable[[str], str]) -> None:
    with ServerProcess(tiny_model_dir("llama"), "--served-model-name", MODEL) as server:
        url = server.base_url
        greedy_before = _greedy_text(server)
        first_engine = server.engine_pid
        # Only what was in flight fails.
        steps_before = kill_engine_mid_requests(server, 8)
        # While the engine starts again, requests are refused for a retry, not queued.
        during = httpx.post(f"{url}{CMPL}", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}, timeout=30)
        if during.status_code != 200:  # the restart may already have finished
            error = assert_error(during, 503, type="service_unavailable")
            assert during.headers["retry-after"] == "1"
            assert "starting again" in error["message"], error

        _wait_healthy(server, timeout=120)
        # Before any new request: nothing the dead engine reported lingers in the gauges.
        assert_idle(server, timeout=0.5)
        assert server.engine_pid != first_engine
        assert not pid_alive(first_engine)
        assert_serves(server)
        # The engine started again is the same engine: a greedy request gives the same text.
        assert _greedy_text(server) == greedy_before
        assert server.metric(RESTARTS) == 1.0
        assert server.metric("cadence:engine_healthy") == 1.0
        assert_idle(server)
        # The counters of the dead engine are kept: the exported totals never go back.
        assert server.metric(STEPS) > steps_before > 0
        assert "starting it again" in server.log() and "serving again" in server.log()


def test_server_exits_nonzero_when_restarts_keep_failing(tiny_model_dir: Callable[[str], str], tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    with ServerProcess(str(model), "--served-model-name", MODEL, "--engine-restart-limit", "2") as server:
        engine = server.engine_pid
        shutil.rmtree(model)  # every later start of the engine fails to load it
        os.kill(engine, signal.SIGKILL)
        returncode = server.process.wait(timeout=120)
        log = server.log()
        assert returncode == 1, log
        assert "failed 2 starts in a row" in log, log
        assert "try 2 of 2" in log, log


def test_sigterm_during_the_backoff_stops_the_server_cleanly(
    tiny_model_dir: Callable[[str], str], tmp_path: Path
) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir("llama"), model)
    with ServerProcess(str(model), "--served-model-name", MODEL) as server:
        engine = server.engine_pid
        shutil.rmtree(model)  # the server keeps trying to start an engine that cannot load
        os.kill(engine, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while "failed to start again" not in server.log() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "failed to start again" in server.log(), server.log()
        # Mid-series (sleeping, or starting another engine): SIGTERM still ends it all.
        children = child_pids(server.process.pid)
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=30) == 0, server.log()
        time.sleep(0.5)
        assert not [c for c in children if pid_alive(c)], "a process outlived the server"
