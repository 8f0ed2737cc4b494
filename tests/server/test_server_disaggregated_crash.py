"""A disaggregated server killed outright leaves no shared memory behind, and a new one serves.

SIGKILL reaches the whole process group (the API and router process, the prefill and the
decode engine) while KV moves, as the OOM killer or a node drain would end them: no
handler, exit hook or finalizer runs. The prefill engine's KV lives in memfds, which the
kernel frees with the last process holding or mapping one, so once those processes are
dead nothing of theirs may remain: no file in /dev/shm, no memfd held by any process.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.disaggregation_checks import FLAGS, complete, prompts, texts_of
from tests.support.server_checks import MODEL
from tests.support.server_harness import ServerProcess, group_members, pid_alive, wait_until
from tests.support.shm_checks import dev_shm_files, holders

pytestmark = [
    pytest.mark.slow,  # two servers of three processes each start
    pytest.mark.skipif(not hasattr(os, "memfd_create"), reason="needs Linux memfds"),
]

SERVER_FLAGS = [
    *("--prefill-workers", "1", "--decode-workers", "1", "--prefill-placement", "remote"),
    *FLAGS,
    *("--served-model-name", MODEL),
]


def transfers(server: ServerProcess) -> float:
    try:
        return server.metric("cadence:kv_transfers_total")
    except KeyError:  # none yet: the counter has no labelled sample
        return 0.0


def complete_until_killed(server: ServerProcess, prompt: list[int], max_tokens: int) -> None:
    try:
        complete(server, prompt, max_tokens, 1)
    except httpx.HTTPError:
        pass  # the server died under the request, as meant


def test_a_killed_server_group_leaves_no_shared_memory_and_a_new_one_serves(
    tiny_model_dir: Callable[[str], str],
) -> None:
    model = tiny_model_dir("llama")
    server = ServerProcess(model, *SERVER_FLAGS, new_group=True)
    members: list[int] = []
    try:
        (prefill,) = server.engine_pids("cadence-prefill")
        (decode,) = server.engine_pids("cadence-decode")
        with ThreadPoolExecutor(8) as pool:
            for prompt, max_tokens, _ in prompts(5, 32):
                pool.submit(complete_until_killed, server, prompt, 40 + max_tokens)
            wait_until(lambda: transfers(server) >= 1, 120, f"no KV transfer happened:\n{server.log()}")
            # The prefill engine holds its KV, and the decode engine maps it to read it.
            assert {prefill, decode} <= holders(f"cadence-kv-{prefill}-")
            members = group_members(server.process.pid)
            assert {server.process.pid, prefill, decode} <= set(members)
            os.killpg(server.process.pid, signal.SIGKILL)
            server.process.wait(60)
            wait_until(lambda: not any(pid_alive(pid) for pid in members), 60, f"{members} outlived SIGKILL")
    finally:
        server.stop()
    assert not dev_shm_files(members), "named shared memory outlived its processes"
    for pid in members:
        assert not holders(f"cadence-kv-{pid}-"), f"KV memory of process {pid} outlived it"
    with ServerProcess(model, *SERVER_FLAGS) as fresh:
        assert texts_of(complete(fresh, list(range(1, 30)), 4, 1))
