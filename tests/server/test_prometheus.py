"""The dashboard and the alert rules against a real Prometheus scraping a real server.

A disaggregated `cadence serve` (so the disaggregation row has data) takes streams, an
abort, a 429, a bad request and a prefix-cache hit; Prometheus (Debian's `prometheus`,
which `.ci/run` installs) scrapes it every second with deploy/prometheus/alerts.yml
loaded. Then every PromQL expression of deploy/grafana/cadence.json and every alert's
signal must return data through Prometheus's HTTP API, and every rule must evaluate
cleanly. The expert-offloading row is the exception: no model offloads experts yet, so
its series are checked to be absent from /metrics instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from cadence.server import metric_series as S
from cadence.tools import grafana_dashboard, prometheus_alerts
from tests.support.server_harness import ServerProcess, free_port

MODEL = "tiny"
EXPERT_SERIES = [S.EXPERT_CACHE_HITS, S.EXPERT_CACHE_MISSES, S.EXPERT_LOAD_BYTES, S.EXPERT_STALL_SECONDS]


def prometheus_binary() -> str:
    found = shutil.which("prometheus")
    if found is None:
        if os.environ.get("CADENCE_REQUIRE_PROMETHEUS"):
            pytest.fail("CI installs Debian's prometheus package; it is missing")
        pytest.skip("no prometheus binary (apt-get install prometheus)")
    return found


async def _load(base_url: str) -> list[int]:
    """Streams and plain requests at once on a server that takes two sequences, one stream
    cut off after its first event, a prompt repeated for a prefix hit, a bad request."""
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:

        async def complete(prompt: list[int], stream: bool, hang_up: bool = False) -> int:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "ignore_eos": True, "stream": stream}
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    if hang_up:
                        break
                return response.status_code

        long_prompt = list(range(20, 60))
        statuses = await asyncio.gather(
            complete(long_prompt, True),
            complete([5, 6, 7], True, hang_up=True),
            *(complete([8, 9], False) for _ in range(3)),
        )
        statuses.append(await complete(long_prompt, False))  # the prefix cache has it now
        bad = await http.post("/v1/completions", json={"model": MODEL, "prompt": [5], "max_tokens": -1})
        statuses.append(bad.status_code)
    return list(statuses)


def query(base: str, expr: str) -> list[dict]:
    response = httpx.get(f"{base}/api/v1/query", params={"query": expr}, timeout=10).json()
    assert response["status"] == "success", (expr, response)
    return response["data"]["result"]


def concrete(expr: str) -> str:
    """A dashboard expression with Grafana's variables filled in."""
    return expr.replace("$model_name", MODEL).replace("$__rate_interval", "1m")


@pytest.fixture(scope="module")
def prometheus_url(
    tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, ServerProcess]]:
    binary = prometheus_binary()
    args = ("--served-model-name", MODEL, "--prefill-workers", "1", "--decode-workers", "1")
    limits = ("--max-num-seqs", "2", "--max-waiting", "0")
    with ServerProcess(tiny_model_dir("llama"), *args, *limits) as server:
        folder: Path = tmp_path_factory.mktemp("prometheus")
        shutil.copy(prometheus_alerts.OUTPUT, folder / "alerts.yml")
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": ["alerts.yml"],
            "scrape_configs": [
                {"job_name": "cadence", "static_configs": [{"targets": [server.base_url.removeprefix("http://")]}]}
            ],
        }
        (folder / "prometheus.yml").write_text(yaml.safe_dump(config), encoding="utf-8")
        port = free_port()
        command = [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        log = open(folder / "prometheus.log", "wb")  # noqa: SIM115 - closed below, after the process
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            # Scraped before the load and after it, so that every rate() sees the change.
            wait_for_scrapes(base, process, folder, 2)
            statuses = asyncio.run(_load(server.base_url))
            assert 429 in statuses and 400 in statuses and 200 in statuses, statuses
            wait_for_scrapes(base, process, folder, 6)
            yield base, server
        finally:
            process.terminate()
            process.wait(timeout=30)
            log.close()


def wait_for_scrapes(base: str, process: subprocess.Popen, folder: Path, count: int) -> None:
    """Until Prometheus has scraped the server `count` times in the last minute."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(1)
        if process.poll() is not None:
            raise RuntimeError((folder / "prometheus.log").read_text(errors="replace")[-3000:])
        try:
            scrapes = query(base, 'count_over_time(up{job="cadence"}[1m])')
        except httpx.TransportError:
            continue
        if scrapes and float(scrapes[0]["value"][1]) >= count:
            return
    raise AssertionError(f"Prometheus did not scrape {count} times within a minute")


def test_every_dashboard_query_returns_data(prometheus_url: tuple[str, ServerProcess]) -> None:
    base, server = prometheus_url
    board = json.loads(grafana_dashboard.OUTPUT.read_text(encoding="utf-8"))
    expert_names = {grafana_dashboard.name(series) for series in EXPERT_SERIES}
    empty, skipped = [], []
    for expr in grafana_dashboard.queries(board):
        if any(name in expr for name in expert_names):
            skipped.append(expr)
            continue
        if expr.startswith("label_values("):
            metric = expr.removeprefix("label_values(").split(",")[0]
            found = httpx.get(f"{base}/api/v1/label/model_name/values", params={"match[]": metric}).json()
            assert found["data"] == [MODEL], found
            continue
        if not query(base, concrete(expr)):
            empty.append(expr)
    assert not empty, f"no data for: {empty}"
    assert len(skipped) == 3  # the expert-offloading row's panels
    exported = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    assert not any(name.removesuffix("_total") in exported for name in expert_names)


def test_every_alert_signal_returns_data_and_every_rule_evaluates(prometheus_url: tuple[str, ServerProcess]) -> None:
    base, _ = prometheus_url
    for alert in prometheus_alerts.ALERTS:
        assert query(base, alert.signal), f"no data for {alert.name}: {alert.signal}"
    firing = [result["metric"]["alertname"] for result in query(base, "ALERTS")]
    assert firing == ["CadenceRequestsRejected"]  # 429s to most of the load: pending, at least
    groups = httpx.get(f"{base}/api/v1/rules", timeout=10).json()["data"]["groups"]
    rules = [rule for group in groups for rule in group["rules"]]
    assert sorted(rule["name"] for rule in rules) == sorted(alert.name for alert in prometheus_alerts.ALERTS)
    assert all(rule["health"] == "ok" for rule in rules), rules


def test_the_generated_files_are_current() -> None:
    assert grafana_dashboard.main(["--check"]) == 0
    assert prometheus_alerts.main(["--check"]) == 0
