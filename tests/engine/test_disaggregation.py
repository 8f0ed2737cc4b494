"""Prefill/decode disaggregation through real engines in one process (LocalCluster).

Every disaggregated run is compared token for token, and logprob for logprob, with one
colocated engine on the same weights and the same mixed workload: long and short prompts,
shared prefixes, prompts chunked over several steps, n > 1. Faults are injected into the
transport and into the coordinator's messages; after every fault each request has either
its colocated tokens or was reported lost or aborted, and both sides' block pools are
whole and idle.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest

from cadence.engine.attention.backend import KVCache
from cadence.engine.engine_args import EngineArgs
from cadence.engine.engine_core import EngineCore
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.kv_transfer.transport import KVTransport
from cadence.engine.protocol import EngineCoreRequest, LoadKV, Message, ReleaseKV
from cadence.engine.sampling_params import SamplingParams
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult
from cadence.server.disaggregation.coordinator import Phase
from cadence.server.disaggregation.local_cluster import LocalCluster
from cadence.server.disaggregation.placement import PlacementPolicy

SETTINGS = {
    "dtype": "float32",
    "block_size": 4,
    "max_model_len": 256,
    "max_num_batched_tokens": 48,  # prompts longer than this are chunked
    "max_num_seqs": 16,
    "num_gpu_blocks": 400,
}
Tokens = dict[str, list[int]]  # "request/index" -> tokens
Logprobs = dict[str, list[float]]


def workload(seed: int = 0, count: int = 32) -> list[EngineCoreRequest]:
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(40)]
    requests = []
    for i in range(count):
        head = shared[: rng.choice([0, 8, 21, 40])]
        prompt = head + [rng.randrange(1, 500) for _ in range(rng.choice([1, 3, 12, 60, 130]))]
        params = SamplingParams(
            max_tokens=rng.randrange(4, 12), temperature=0.0, ignore_eos=True, n=2 if i % 7 == 3 else 1, logprobs=1
        )
        requests.append(EngineCoreRequest(f"r{i}", prompt, params))
    return requests


def engine(path: str, role: str = "colocated", **options: object) -> EngineCore:
    return EngineCore(EngineArgs(path, **{**SETTINGS, "kv_role": role, **options}))  # type: ignore[arg-type]


def collect(step: Callable[[], list], tokens: Tokens, logprobs: Logprobs) -> None:
    for out in step():
        key = f"{out.request_id}/{out.index}"
        tokens.setdefault(key, []).extend(out.new_token_ids)
        logprobs.setdefault(key, []).extend(lp[1][0] for lp in out.new_logprobs or [])


@pytest.fixture(scope="module")
def model(tiny_model_dir: Callable[[str], str]) -> str:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model: str) -> tuple[Tokens, Logprobs]:
    core = engine(model)
    for request in workload():
        core.add_request(request)
    tokens: Tokens = {}
    logprobs: Logprobs = {}
    while core.has_unfinished_requests():
        collect(core.step, tokens, logprobs)
    return tokens, logprobs


def assert_idle(cluster: LocalCluster, cores: list[EngineCore]) -> None:
    """Nothing parked, held or running anywhere, and every block back in its pool."""
    assert not cluster.coordinator.routes
    for core in cores:
        scheduler, connector = core.scheduler, core.kv_connector
        assert connector is not None
        scheduler.check_integrity()
        assert not scheduler.requests and not connector.awaiting_kv and not connector.held_kv
        assert scheduler.kv_cache.pool.num_free_blocks == core.num_kv_blocks


def run(
    cluster: LocalCluster, requests: list[EngineCoreRequest], hook: Callable[[int], None] | None = None
) -> tuple[Tokens, Logprobs]:
    for request in requests:
        cluster.add_request(request)
    tokens: Tokens = {}
    logprobs: Logprobs = {}
    deadline = time.monotonic() + 60
    index = 0
    while time.monotonic() < deadline:
        if not cluster.has_unfinished_requests():
            return tokens, logprobs
        index += 1
        if hook is not None:
            hook(index)
        collect(cluster.step, tokens, logprobs)
        for core in cluster.engines.values():
            core.scheduler.check_integrity()
    raise AssertionError(f"the cluster did not finish: {cluster._remaining} {cluster.coordinator.routes}")


def drain(cluster: LocalCluster, seconds: float = 5.0) -> None:
    """Step until no engine holds or waits for prompt KV (or `seconds` pass)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        cluster.step()
        connectors = [core.kv_connector for core in cluster.engines.values() if core.kv_connector is not None]
        if not any(connector.held_kv or connector.awaiting_kv for connector in connectors):
            return


@pytest.mark.parametrize("num_decode", [1, 2])
def test_disaggregated_greedy_matches_colocated(
    model: str, reference: tuple[Tokens, Logprobs], num_decode: int
) -> None:
    prefill = [engine(model, "prefill")]
    decode = [engine(model, "decode") for _ in range(num_decode)]
    cluster = LocalCluster(prefill, decode)
    tokens, logprobs = run(cluster, workload())
    assert tokens == reference[0]
    assert logprobs == reference[1]
    coordinator = cluster.coordinator
    assert coordinator.stats.num_remote_prefills >= 20, "most prompts must go through a transfer"
    assert coordinator.stats.num_local_prefills >= 1, "one-token prompts and cache hits stay on the decode engine"
    if num_decode == 2:
        served = {core.stats().num_steps > 0 for core in decode}
        assert served == {True}, "both decode engines take work"
    drain(cluster)
    assert_idle(cluster, prefill + decode)


def test_prefix_hits_on_the_decode_side_shrink_the_transfer(model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    prefill, decode = engine(model, "prefill"), engine(model, "decode")
    cluster = LocalCluster([prefill], [decode])
    prompt = list(range(10, 90))
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    run(cluster, [EngineCoreRequest("first", prompt, params)])
    loads: list[KVLoad] = []
    connector = decode.kv_connector
    assert connector is not None
    original = connector.start_kv_load

    def spy(request_id: str, source: object, block_ids: list[int]) -> str | None:
        result = original(request_id, source, block_ids)
        loads.extend(connector._kv_loads)
        return result

    monkeypatch.setattr(connector, "start_kv_load", spy)
    run(cluster, [EngineCoreRequest("second", prompt + [5, 6, 7, 8, 9, 10, 11], params)])
    (load,) = loads
    assert len(load.local_block_ids) == 2, "only blocks past the 80 cached tokens move"
    drain(cluster)
    assert_idle(cluster, [prefill, decode])


class FaultyTransport(KVTransport):
    """Wraps a decode engine's transport: breaks some loads part way ("broken"), holds
    them until cancelled ("hang": a transfer that never completes), or lets every load
    take one more step ("slow")."""

    name = "faulty"

    def __init__(self, inner: KVTransport, mode: str, rng: random.Random) -> None:
        self.inner, self.mode, self.rng = inner, mode, rng
        self.held: dict[str, KVLoad] = {}
        self.slowed: dict[str, KVLoad] = {}
        self.results: list[KVLoadResult] = []
        self.num_faults = 0

    def export(self, kv_caches: list[KVCache], layout: KVLayout) -> KVSource:
        return self.inner.export(kv_caches, layout)

    def start_load(self, load: KVLoad, kv_caches: list[KVCache]) -> None:
        self.kv_caches = kv_caches
        if self.mode == "slow":
            self.held[load.request_id] = load
            return
        if self.rng.random() < 0.5:
            self.inner.start_load(load, kv_caches)
            return
        self.num_faults += 1
        if self.mode == "hang":
            self.held[load.request_id] = load
            return
        # Some blocks arrive, then the transfer breaks.
        count = self.rng.randrange(len(load.local_block_ids))
        partial = KVLoad(load.request_id, load.source, load.remote_block_ids[:count], load.local_block_ids[:count])
        earlier = self.inner.poll()
        self.inner.start_load(partial, kv_caches)
        self.inner.poll()
        self.results += earlier + [KVLoadResult(load.request_id, count, "the connection dropped")]

    def cancel(self, request_id: str) -> None:
        if self.held.pop(request_id, None) is not None or self.slowed.pop(request_id, None) is not None:
            self.results.append(KVLoadResult(request_id, 0, "cancelled"))

    def poll(self) -> list[KVLoadResult]:
        if self.mode == "slow":
            for load in self.slowed.values():
                self.inner.start_load(load, self.kv_caches)
            self.slowed, self.held = self.held, {}
        results, self.results = self.inner.poll() + self.results, []
        return results

    def close(self) -> None:
        self.inner.close()


def test_a_decode_engine_waits_on_when_told_its_prompt_is_being_computed(model: str) -> None:
    decode = engine(model, "decode", kv_wait_timeout=5.0)
    decode.add_request(EngineCoreRequest("r", list(range(1, 40)), SamplingParams(max_tokens=2), remote_kv="load"))
    decode.step()
    (reservation,) = decode.take_kv_events().reserved
    first = decode.next_kv_deadline()
    assert reservation.request_id == "r" and first is not None
    time.sleep(0.05)
    decode.extend_kv_wait(["r", "unknown"])
    later = decode.next_kv_deadline()
    assert later is not None and later >= first + 0.05
    decode.close()


@pytest.mark.parametrize("mode", ["broken", "hang"])
def test_broken_and_stuck_transfers_recompute_the_rest(
    model: str, reference: tuple[Tokens, Logprobs], mode: str
) -> None:
    prefill = engine(model, "prefill")
    # Stuck loads end by the wait deadline: long enough for prompts to be computed on a busy
    # machine, short enough for a test.
    decode = engine(model, "decode", kv_wait_timeout=2.0 if mode == "hang" else 30.0)
    assert decode.runner.kv_connector is not None
    faulty = FaultyTransport(decode.runner.kv_connector.transport, mode, random.Random(1))
    decode.runner.kv_connector.transport = faulty
    cluster = LocalCluster([prefill], [decode])
    tokens, logprobs = run(cluster, workload())
    assert faulty.num_faults >= 3
    assert (tokens, logprobs) == reference
    if mode == "hang":
        assert decode.num_expired_kv >= 1, "stuck loads end by the wait deadline"
    drain(cluster)
    assert_idle(cluster, [prefill, decode])


@pytest.mark.parametrize("fault", ["duplicate", "delay", "drop"])
def test_lost_duplicated_and_late_messages(model: str, reference: tuple[Tokens, Logprobs], fault: str) -> None:
    # Lost messages end by these deadlines: long enough for every prompt to be computed on a
    # busy machine, so that only lost messages end by them.
    prefill = engine(model, "prefill", kv_hold_timeout=6.0)
    decode = engine(model, "decode", kv_wait_timeout=5.0)
    cluster = LocalCluster([prefill], [decode])
    deliver = cluster.coordinator.send
    late: list[tuple[str, Message]] = []
    rng = random.Random(2)

    def send(engine_id: str, message: Message) -> None:
        if fault == "drop" and isinstance(message, ReleaseKV) and rng.random() < 0.4:
            return  # lost: the prefill engine's deadline frees the blocks
        if isinstance(message, LoadKV) and rng.random() < 0.4:
            if fault == "duplicate":
                deliver(engine_id, message)
            elif fault == "delay":
                late.append((engine_id, message))
                return
            else:
                return  # lost: the decode engine's deadline ends its wait
        deliver(engine_id, message)

    cluster.coordinator.send = send

    def release_late(_: int) -> None:
        if late and rng.random() < 0.3:
            deliver(*late.pop(0))

    tokens, logprobs = run(cluster, workload(), release_late)
    assert (tokens, logprobs) == reference
    for engine_id, message in late:
        deliver(engine_id, message)  # arrive after everything finished: ignored
    drain(cluster, seconds=15.0)
    if fault == "drop":
        # Lost loads end by the decode side's deadline, lost acknowledgements by the prefill side's.
        assert decode.num_expired_kv >= 1 and prefill.num_expired_kv >= 1
    assert_idle(cluster, [prefill, decode])


@pytest.mark.parametrize("num_prefill", [1, 2])
def test_prefill_engine_dies_mid_flight(model: str, reference: tuple[Tokens, Logprobs], num_prefill: int) -> None:
    prefills = [engine(model, "prefill") for _ in range(num_prefill)]
    decode = engine(model, "decode")
    cluster = LocalCluster(prefills, [decode])

    def kill(step: int) -> None:
        if step == 6:
            busy = [r for r in cluster.coordinator.routes.values() if r.phase is Phase.PREFILLING]
            assert busy, "the prefill engine must die with work in hand"
            assert cluster.remove_engine("prefill-0") == []

    tokens, logprobs = run(cluster, workload(), kill)
    assert (tokens, logprobs) == reference
    if num_prefill == 2:
        assert cluster.coordinator.stats.num_rerouted >= 1
    drain(cluster)
    assert_idle(cluster, prefills[1:] + [decode])


def test_decode_engine_dies_and_its_requests_are_reported_lost(model: str, reference: tuple[Tokens, Logprobs]) -> None:
    prefill = engine(model, "prefill")
    decodes = [engine(model, "decode"), engine(model, "decode")]
    cluster = LocalCluster([prefill], decodes)
    lost: list[str] = []

    def kill(step: int) -> None:
        if step == 5:
            lost.extend(cluster.remove_engine("decode-1"))

    tokens, logprobs = run(cluster, workload(), kill)
    assert lost
    survivors = {k: v for k, v in reference[0].items() if k.split("/")[0] not in lost}
    assert {k: v for k, v in tokens.items() if k.split("/")[0] not in lost} == survivors
    drain(cluster)
    assert_idle(cluster, [prefill, decodes[0]])


def test_client_aborts_in_every_phase_free_both_sides(model: str, reference: tuple[Tokens, Logprobs]) -> None:
    prefill = engine(model, "prefill")
    decode = engine(model, "decode")
    # Loads take a step, so that a client can go away while one runs.
    worker = decode.runner.kv_connector
    assert worker is not None
    worker.transport = FaultyTransport(worker.transport, "slow", random.Random(0))
    cluster = LocalCluster([prefill], [decode])
    aborted: dict[str, Phase] = {}

    def abort(_: int) -> None:
        """Abort the first request seen in each phase."""
        for request_id, route in list(cluster.coordinator.routes.items()):
            if route.phase not in aborted.values():
                aborted[request_id] = route.phase
                cluster.abort_requests([request_id])

    tokens, _ = run(cluster, workload(), abort)
    assert set(aborted.values()) == set(Phase), "every phase must have been hit"
    kept = {k: v for k, v in reference[0].items() if k.split("/")[0] not in aborted}
    assert {k: v for k, v in tokens.items() if k.split("/")[0] not in aborted} == kept
    drain(cluster)
    assert_idle(cluster, [prefill, decode])


def test_decode_engine_short_of_blocks_still_serves_everything(model: str, reference: tuple[Tokens, Logprobs]) -> None:
    prefill = engine(model, "prefill")
    decode = engine(model, "decode", num_gpu_blocks=70)  # a few long prompts at a time
    cluster = LocalCluster([prefill], [decode])
    tokens, logprobs = run(cluster, workload())
    assert (tokens, logprobs) == reference
    drain(cluster)
    assert_idle(cluster, [prefill, decode])


def test_a_colocated_engine_builds_no_connector(model: str) -> None:
    core = engine(model)
    assert core.kv_connector is None and core.scheduler.connector is None and core.runner.kv_connector is None
    assert core.take_kv_events().reserved == [] and core.next_kv_deadline() is None
    assert not core.expire_kv_deadlines() and core.stats().num_waiting_for_kv == 0


def test_engines_with_other_kv_layouts_are_refused(model: str) -> None:
    prefill = engine(model, "prefill", block_size=8)
    decode = engine(model, "decode")
    with pytest.raises(ValueError, match="block_size 8 != 4|block_size 4 != 8"):
        LocalCluster([prefill], [decode])


def test_one_token_requests_computed_on_the_decode_engine(model: str) -> None:
    """Waits that end outside a step (by the router's choice) for requests that finish in
    their next step: the events must still name them."""
    requests = [
        EngineCoreRequest(r.request_id, r.prompt_token_ids, SamplingParams(max_tokens=1, temperature=0.0, n=n))
        for r, n in zip(workload(count=8), [1, 2] * 4)
    ]
    colocated = engine(model)
    for request in requests:
        colocated.add_request(request)
    expected: Tokens = {}
    while colocated.has_unfinished_requests():
        collect(colocated.step, expected, {})
    prefill, decode = engine(model, "prefill"), engine(model, "decode")
    cluster = LocalCluster([prefill], [decode], placement=PlacementPolicy(min_remote_prefill_tokens=1000))
    tokens, _ = run(cluster, requests)
    assert tokens == expected
    assert cluster.coordinator.stats.num_remote_prefills == 0
    drain(cluster)
    assert_idle(cluster, [prefill, decode])
