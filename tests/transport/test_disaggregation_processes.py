"""Prefill and decode engines as separate processes, KV through shared memory.

The engines run the real engine loop (engine/core_process.py) behind ZMQ, and the
`Coordinator` routes between them, as a router would. Greedy tokens must equal one
colocated engine's, and stay equal when the prefill process is killed mid-flight: its
prompts are then computed on the decode engine. Once the engines are gone, nothing holds
their shared-memory KV.
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable

import pytest
import zmq
import zmq.asyncio

from cadence.engine.engine_args import EngineArgs
from cadence.engine.protocol import EngineCoreOutputs, EngineCoreRequest, EngineDead, Message
from cadence.server.disaggregation.coordinator import Coordinator, Phase
from cadence.server.engine_process import EngineDeadError, EngineProcess
from cadence.server.ipc_addresses import address_prefix
from tests.engine.test_disaggregation import SETTINGS, Logprobs, Tokens, engine, workload
from tests.support.shm_checks import dev_shm_files, holders

pytestmark = pytest.mark.slow  # three engine processes start


async def serve(
    model: str, requests: list[EngineCoreRequest], kill_prefill_at_step: int | None, pids: list[int]
) -> Tokens:
    """Run `requests` through one prefill and one decode process (their pids go to `pids`);
    the decode side's tokens."""
    send_context, recv_context = zmq.Context(), zmq.asyncio.Context()
    processes: dict[str, EngineProcess] = {}
    prefix = address_prefix()
    try:
        for generation, role in enumerate(("prefill", "decode")):
            args = EngineArgs(model, **{**SETTINGS, "kv_role": role, "kv_transport": "shared-memory"})  # type: ignore[arg-type]
            processes[f"{role}-0"] = EngineProcess(args, prefix, generation, send_context, recv_context)
        readies = {name: await process.wait_ready(120) for name, process in processes.items()}
        pids.extend(p.process.pid for p in processes.values() if p.process.pid is not None)

        def send(engine_id: str, message: Message) -> None:
            process = processes.get(engine_id)
            if process is not None:
                try:
                    process.send(message)
                except EngineDeadError:
                    pass  # the engine died; its exit is handled where it is noticed

        coordinator = Coordinator(send)
        for name, ready in readies.items():
            coordinator.add_engine(name, ready)
        remaining = {r.request_id: r.sampling_params.n for r in requests}
        for request in requests:
            coordinator.add_request(request)
        tokens: Tokens = {}
        decode_steps = 0
        receivers = {name: asyncio.ensure_future(p.recv()) for name, p in processes.items()}
        while remaining:
            done, _ = await asyncio.wait(receivers.values(), timeout=60, return_when=asyncio.FIRST_COMPLETED)
            assert done, f"no engine said anything for a minute: {coordinator.routes}"
            for name, future in list(receivers.items()):
                if future not in done:
                    continue
                message = future.result()
                assert not isinstance(message, EngineDead), message
                assert isinstance(message, EngineCoreOutputs)
                coordinator.on_outputs(name, message)
                receivers[name] = asyncio.ensure_future(processes[name].recv())
                if name.startswith("decode"):
                    decode_steps += 1
                    for out in message.outputs:
                        tokens.setdefault(f"{out.request_id}/{out.index}", []).extend(out.new_token_ids)
                        if out.finished:
                            remaining[out.request_id] -= 1
                            if not remaining[out.request_id]:
                                del remaining[out.request_id]
                                coordinator.finished(out.request_id)
            if kill_prefill_at_step is not None and decode_steps >= kill_prefill_at_step and "prefill-0" in processes:
                assert any(r.phase is Phase.PREFILLING for r in coordinator.routes.values())
                victim = processes.pop("prefill-0")
                assert victim.process.pid is not None
                os.kill(victim.process.pid, signal.SIGKILL)
                victim.process.join(10)
                receivers.pop("prefill-0").cancel()
                coordinator.remove_engine("prefill-0")
                await victim.stop(1)
        for future in receivers.values():
            future.cancel()
        return tokens
    finally:
        for process in processes.values():
            await process.stop(10)
        send_context.term()
        recv_context.term()


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def colocated(model: str) -> Tokens:
    core = engine(model)
    for request in workload():
        core.add_request(request)
    tokens: Tokens = {}
    logprobs: Logprobs = {}
    while core.has_unfinished_requests():
        for out in core.step():
            key = f"{out.request_id}/{out.index}"
            tokens.setdefault(key, []).extend(out.new_token_ids)
            logprobs.setdefault(key, [])
    return tokens


@pytest.mark.parametrize("kill_prefill_at_step", [None, 3])
def test_engine_processes_match_colocated(model: str, colocated: Tokens, kill_prefill_at_step: int | None) -> None:
    pids: list[int] = []
    tokens = asyncio.run(serve(model, workload(), kill_prefill_at_step, pids))
    assert tokens == colocated
    assert len(pids) == 2 and not dev_shm_files(pids)
    for pid in pids:
        assert not holders(f"cadence-kv-{pid}-"), f"the KV memory of engine process {pid} outlived it"
