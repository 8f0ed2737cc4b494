"""`cadence router` over workers (`cadence serve --role prefill|decode`), end to end.

The prefill worker runs on another "host": a network namespace joined by a veth pair
where the tests run as root (else loopback), so its KV crosses a real link over TCP.
Two decode workers and the router run here. The router must give the offline
colocated engine's greedy text; follow its worker file; lose no request when the
prefill worker is killed, and take it back when it returns; and a router that dies
must strand nothing on the workers once the link's timeout has passed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.disaggregation_checks import (
    FLAGS,
    burst_texts,
    complete,
    offline_texts,
    prompts,
    texts_of,
    wait_health,
)
from tests.support.network_namespace import Hosts, other_host
from tests.support.server_checks import MODEL
from tests.support.server_harness import ServerProcess

pytestmark = pytest.mark.slow  # four servers and their engines start

LINK_TIMEOUT = 3.0
# Prompt KV offered to a reader outlives a router that died by the hold deadline at most.
KV_HOLD_TIMEOUT = 10.0
WORKER_FLAGS = [*FLAGS, "--served-model-name", MODEL, "--link-timeout", str(LINK_TIMEOUT)]
WORKER_FLAGS += ["--kv-wait-timeout", str(KV_HOLD_TIMEOUT - 2), "--kv-hold-timeout", str(KV_HOLD_TIMEOUT)]
# Every prompt to a prefill worker: these tests are about the links, not the cost model.
ROUTER_FLAGS = ["--prefill-placement", "remote", "--link-timeout", str(LINK_TIMEOUT), "--served-model-name", MODEL]


@dataclass
class Cluster:
    model: str
    hosts: Hosts
    prefill: ServerProcess
    decode: list[ServerProcess]
    router: ServerProcess
    workers_file: str
    stack: ExitStack

    def start_prefill(self, port: int | None = None) -> ServerProcess:
        flags = ["--role", "prefill", "--kv-transport", "tcp", *WORKER_FLAGS]
        server = ServerProcess(self.model, *flags, host=self.hosts.there, port=port, wrapper=self.hosts.wrapper)
        return self.stack.enter_context(server)

    def write_workers(self, decode: list[ServerProcess]) -> None:
        listed = {"prefill": [self.prefill.base_url], "decode": [server.base_url for server in decode]}
        with open(self.workers_file + ".new", "w", encoding="utf-8") as f:
            json.dump(listed, f)
        os.replace(self.workers_file + ".new", self.workers_file)


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    model = tiny_model_dir("llama")
    with ExitStack() as stack:
        hosts = stack.enter_context(other_host())
        holder = Cluster(model, hosts, None, [], None, str(tmp_path_factory.mktemp("router") / "workers.json"), stack)  # type: ignore[arg-type]
        with ThreadPoolExecutor(3) as pool:  # the three workers load their models at once
            prefill = pool.submit(holder.start_prefill)
            decode = [
                pool.submit(lambda: stack.enter_context(ServerProcess(model, "--role", "decode", *WORKER_FLAGS)))
                for _ in range(2)
            ]
            holder.prefill, holder.decode = prefill.result(), [future.result() for future in decode]
        holder.write_workers(holder.decode)
        flags = ["--workers-file", holder.workers_file, *ROUTER_FLAGS]
        holder.router = stack.enter_context(ServerProcess(model, *flags, command="router"))
        for server in [holder.prefill, *holder.decode]:
            wait_health(holder.router, server.base_url, "serving")
        yield holder


def metric(server: ServerProcess, name: str, **labels: str) -> float:
    """One series of the server's /metrics, every sample labelled with the model's name."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels.get("model_name") == MODEL, f"{sample.name} lacks model_name: {sample.labels}"
            if sample.name == name and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def test_the_router_gives_the_colocated_text(cluster: Cluster) -> None:
    burst = prompts(0, 24)
    responses = burst_texts(cluster.router, burst)
    assert [texts_of(r) for r in responses] == offline_texts(cluster.model, burst), cluster.hosts.kind
    assert metric(cluster.router, "cadence:prefills_total", engine_role="prefill") >= 12.0
    assert metric(cluster.router, "cadence:kv_transfer_bytes_total") > 0.0
    assert metric(cluster.router, "cadence:kv_transfers_total", outcome="incomplete") == 0.0
    for decode in cluster.decode:  # both decode workers took requests, and are idle again
        assert metric(decode, "cadence:generation_tokens_total") > 0.0
        assert metric(decode, "cadence:num_requests_running") == 0.0
    assert metric(cluster.prefill, "cadence:num_requests_running") == 0.0


def test_the_router_follows_its_worker_file(cluster: Cluster) -> None:
    gone = cluster.decode[1].base_url
    cluster.write_workers(cluster.decode[:1])
    deadline = time.monotonic() + 20
    while gone in httpx.get(f"{cluster.router.base_url}/health", timeout=5).json()["engines"]:
        assert time.monotonic() < deadline, cluster.router.log()
        time.sleep(0.2)
    before = metric(cluster.decode[1], "cadence:generation_tokens_total")
    burst = prompts(3, 6)
    assert [texts_of(r) for r in burst_texts(cluster.router, burst)] == offline_texts(cluster.model, burst)
    assert metric(cluster.decode[1], "cadence:generation_tokens_total") == before  # it got none of them
    cluster.write_workers(cluster.decode)
    wait_health(cluster.router, gone, "serving")


def test_a_dead_prefill_worker_costs_no_request_and_is_taken_back(cluster: Cluster) -> None:
    burst = prompts(1, 16)
    computed_on_decode = metric(cluster.router, "cadence:prefills_total", engine_role="decode")

    def kill() -> None:
        time.sleep(0.3)
        cluster.prefill.stop(signal.SIGKILL)

    responses = burst_texts(cluster.router, burst, kill)
    assert [texts_of(r) for r in responses] == offline_texts(cluster.model, burst)
    # The burst outlived the worker: some of its prompts were computed on decode workers.
    assert metric(cluster.router, "cadence:prefills_total", engine_role="decode") > computed_on_decode
    assert httpx.get(f"{cluster.router.base_url}/health", timeout=5).status_code == 200
    cluster.prefill = cluster.start_prefill(port=cluster.prefill.port)
    wait_health(cluster.router, cluster.prefill.base_url, "serving")
    before = metric(cluster.router, "cadence:prefills_total", engine_role="prefill")
    burst = prompts(2, 6)
    assert [texts_of(r) for r in burst_texts(cluster.router, burst)] == offline_texts(cluster.model, burst)
    assert metric(cluster.router, "cadence:prefills_total", engine_role="prefill") > before


def test_a_dead_router_strands_nothing_on_its_workers(cluster: Cluster) -> None:
    urls = ["--prefill", cluster.prefill.base_url, "--decode", cluster.decode[0].base_url]
    doomed = ServerProcess(cluster.model, *urls, *ROUTER_FLAGS, command="router")
    decode = cluster.decode[0]
    with ThreadPoolExecutor(6) as pool:
        for index in range(6):  # 24 sequences of 220 tokens: seconds of work for the decode worker
            pool.submit(complete, doomed, list(range(1 + index, 30)), 220, 4)
        deadline = time.monotonic() + 30
        while metric(decode, "cadence:num_requests_running") < 4:
            assert time.monotonic() < deadline, decode.log()
            time.sleep(0.05)
        doomed.stop(signal.SIGKILL)
        killed_at = time.monotonic()
    for worker in (decode, cluster.prefill):
        while metric(worker, "cadence:num_requests_running") + metric(worker, "cadence:kv_cache_usage_perc") > 0:
            assert time.monotonic() < killed_at + KV_HOLD_TIMEOUT + 10, worker.log()
            time.sleep(0.2)
    # The worker saw the connection drop, and aborted what that router had started.
    assert re.search(r"ended \(the router's connection dropped\); aborting its [1-9]\d* requests", decode.log())
    assert texts_of(complete(cluster.router, list(range(1, 30)), 4, 1))  # the other router is unaffected
