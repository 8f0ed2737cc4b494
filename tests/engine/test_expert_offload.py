"""Expert offloading (engine/experts/) through the engine on tiny random MoE models: with
the routed experts in host memory or memory-mapped from disk and a cache smaller than a
layer's experts, greedy tokens are identical to the fully resident model's under 16
concurrent requests, with dense and quantized experts, under chunked prefill and
preemption; the counters say what happened; and the options are checked."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch

from cadence.engine.experts.cache import replay
from cadence.engine.experts.offloaded import OffloadedExperts, offloaded_stats
from cadence.engine.experts.options import ExpertOffloadOptions
from cadence.engine.experts.stats import ExpertStats
from cadence.engine.experts.store import ExpertSource, slot_tensors
from cadence.engine.llm import LLM
from cadence.engine.loader import load_model
from cadence.engine.models.moe import SparseMoeBlock
from cadence.engine.quantization.linear_layer import LinearLayer
from cadence.kernels.cpu.kernel_names import HELD_KERNELS
from tests.support.helpers import greedy, make_llm, rel_err
from tests.support.sdpa_contexts import VarlenSdpaContext
from tests.support.tiny_models import MOE_KINDS

MAX_TOKENS = 8
# 16 prompts of different lengths (make_llm's blocks hold 4 tokens), so the batch is ragged.
PROMPTS = [[3 + i, 7 + 2 * i, 11] + [40 + (5 * i + j) % 400 for j in range(i)] for i in range(16)]


def _generate(llm: LLM) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(MAX_TOKENS))
    return [o.outputs[0].token_ids for o in outputs]


_RESIDENT: dict[tuple[str, str | None], list[list[int]]] = {}


def _quantized(quantization: str | None) -> dict[str, object]:
    """Engine options for ``quantization``, on one CPU kernel where quantized: the planner
    times an offloaded model's few expert slots apart from a resident model's experts, and
    at a near tie may give them another kernel (other bits)."""
    return (
        {"quantization": quantization}
        if quantization is None
        else {"quantization": quantization, "cpu_kernels": "packed"}
    )


def _resident(path: str, kind: str, quantization: str | None = None) -> list[list[int]]:
    if (kind, quantization) not in _RESIDENT:
        _RESIDENT[(kind, quantization)] = _generate(make_llm(path, max_num_seqs=16, **_quantized(quantization)))
    return _RESIDENT[(kind, quantization)]


def _stats(llm: LLM) -> ExpertStats:
    stats = offloaded_stats(llm.engine.model)
    assert stats is not None
    return stats


@pytest.mark.parametrize("kind", MOE_KINDS)
@pytest.mark.parametrize("mode", ["host", "disk"])
@pytest.mark.parametrize("stream", [False, True])
def test_offloaded_tokens_match_resident(
    kind: str, mode: str, stream: bool, tiny_model_dir: Callable[[str], str]
) -> None:
    """One slot per layer (fewer than any step's experts): every step runs in waves
    through the cache (the CPU default) or streams its misses through the two buffers,
    and the tokens are still the resident model's."""
    path = tiny_model_dir(kind)
    threshold = 1 if stream else None
    llm = make_llm(path, max_num_seqs=16, expert_offload=mode, expert_cache_size=1, expert_stream_threshold=threshold)
    assert _generate(llm) == _resident(path, kind)
    stats = _stats(llm)
    assert stats.misses > 0
    # On a CPU device host memory is the slots' memory: a host load binds, a disk load copies.
    assert (stats.load_bytes > 0) == (mode == "disk")
    if stream:
        assert stats.streamed_layers > 0 and stats.cached_layers == 0
    else:
        assert stats.streamed_layers == 0 and stats.cached_layers > 0 and stats.waves > 0


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("mode", ["host", "disk"])
def test_quantized_experts_offload(quantization: str, mode: str, tiny_model_dir: Callable[[str], str]) -> None:
    """Quantized experts (disk: spilled once to a mapped file) give the resident quantized
    model's tokens."""
    path = tiny_model_dir("mixtral")
    llm = make_llm(path, max_num_seqs=16, **_quantized(quantization), expert_offload=mode, expert_cache_size=2)
    assert _generate(llm) == _resident(path, "mixtral", quantization)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_policies_streaming_and_prefetch_off_keep_tokens(policy: str, tiny_model_dir: Callable[[str], str]) -> None:
    """Each policy, with streaming forced for every step and prefetch off, and with
    streaming never used: the same tokens; the counters follow the choice."""
    path = tiny_model_dir("qwen2_moe")
    always = make_llm(
        path,
        max_num_seqs=16,
        expert_offload="host",
        expert_cache_size=3,
        expert_cache_policy=policy,
        expert_stream_threshold=0,
        expert_prefetch=False,
    )
    assert _generate(always) == _resident(path, "qwen2_moe")
    stats = _stats(always)
    assert stats.streamed_layers > 0 and stats.cached_layers == 0
    assert stats.prefetch_loads == 0 and stats.prefetch_predicted == 0
    never = make_llm(
        path,
        max_num_seqs=16,
        expert_offload="host",
        expert_cache_size=3,
        expert_cache_policy=policy,
        expert_stream_threshold=6,
    )
    assert _generate(never) == _resident(path, "qwen2_moe")
    stats = _stats(never)
    assert stats.streamed_layers == 0 and stats.cached_layers > 0 and stats.waves > 0


def test_prefetch_loads_the_next_layers_experts(tiny_model_dir: Callable[[str], str]) -> None:
    """Mixtral's second layer gets its predicted experts loaded while the first computes;
    most predictions are routed (the residual stream changes little in one layer)."""
    path = tiny_model_dir("mixtral")
    llm = make_llm(path, max_num_seqs=16, expert_offload="host", expert_cache_size=4, expert_stream_threshold=8)
    assert _generate(llm) == _resident(path, "mixtral")
    stats = _stats(llm)
    assert stats.prefetch_loads > 0
    assert 0 < stats.prefetch_correct <= min(stats.prefetch_predicted, stats.prefetch_routed)
    assert stats.prefetch_precision > 0.5 and stats.prefetch_recall > 0.5


def test_chunked_prefill_and_preemption(tiny_model_dir: Callable[[str], str]) -> None:
    """Prompts cut into 5-token chunks, and a KV cache so small that sequences are
    preempted and recomputed: the resident model's tokens."""
    path = tiny_model_dir("qwen3_moe")
    options = dict(max_num_seqs=16, long_prefill_token_threshold=5, num_gpu_blocks=24)
    resident = _generate(make_llm(path, **options))
    offloaded = make_llm(path, expert_offload="disk", expert_cache_size=1, **options)
    assert _generate(offloaded) == resident == _resident(path, "qwen3_moe")
    assert offloaded.engine._num_preemptions > 0


def test_hit_rate_with_every_expert_cached(tiny_model_dir: Callable[[str], str]) -> None:
    """With a slot for every expert, each expert is loaded once: the first layer's on
    their first use (misses), the second's ahead of it by the prefetch (then hits). The
    counters are exact."""
    path = tiny_model_dir("qwen3_moe")  # 4 experts
    llm = make_llm(path, max_num_seqs=16, expert_offload="disk", expert_cache_size=4)
    _generate(llm)
    stats = _stats(llm)
    layers = llm.engine.model_config.num_hidden_layers
    assert layers == 2 and stats.misses == 4 and stats.prefetch_loads == 4
    assert stats.streamed_layers == 0 and stats.waves == 0
    expert_bytes = sum(s.nbytes for s in _offloaded_layers(llm)[0].sources)
    assert stats.load_bytes == expert_bytes * layers


def _offloaded_layers(llm: LLM) -> list[OffloadedExperts]:
    return [m for m in llm.engine.model.modules() if isinstance(m, OffloadedExperts)]


def test_no_expert_is_allocated_beyond_the_slots(tiny_model_dir: Callable[[str], str]) -> None:
    """The model holds its slots and two stream buffers per layer, and no expert list."""
    path = tiny_model_dir("mixtral")
    model, config = load_model(path, torch.float32, expert_offload=ExpertOffloadOptions("disk", cache_size=2))
    layers = [m for m in model.modules() if isinstance(m, OffloadedExperts)]
    assert len(layers) == config.num_hidden_layers
    for layer in layers:
        assert len(layer.slots) == 2 + 2 and layer.num_experts == 8
    resident, _ = load_model(path, torch.float32)
    assert isinstance(resident, torch.nn.Module) and isinstance(model, torch.nn.Module)
    expert_params = sum(p.numel() for n, p in resident.named_parameters() if ".experts." in n)
    slot_params = sum(p.numel() for n, p in model.named_parameters() if ".slots." in n)
    assert slot_params == expert_params * 4 // 8


def test_options_are_checked(tiny_model_dir: Callable[[str], str]) -> None:
    """Offloading a dense model, an unknown mode and CPU compute on a CPU are refused."""
    with pytest.raises(ValueError, match="mixture-of-experts"):
        make_llm(tiny_model_dir("llama"), expert_offload="host")
    with pytest.raises(ValueError, match="expert_offload must be one of"):
        make_llm(tiny_model_dir("mixtral"), expert_offload="gpu")
    with pytest.raises(ValueError, match="CUDA"):
        make_llm(tiny_model_dir("mixtral"), expert_offload="host", expert_cpu_compute=True)


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_slow_loads_are_waited_for(
    quantization: str | None, tiny_model_dir: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Disk loads made slow on the loader thread, with eviction, waves and prefetch (3
    slots of 8, never streaming): a run that did not wait for its slot's load would read
    the previous expert's weights and change the tokens."""
    path = tiny_model_dir("mixtral")
    copy_into = ExpertSource.copy_into

    def slow_copy(self: ExpertSource, tensors: dict[str, torch.Tensor], non_blocking: bool = False) -> int:
        time.sleep(0.002)
        return copy_into(self, tensors, non_blocking)

    monkeypatch.setattr(ExpertSource, "copy_into", slow_copy)
    llm = make_llm(
        path,
        max_num_seqs=16,
        **_quantized(quantization),
        expert_offload="disk",
        expert_cache_size=3,
        expert_stream_threshold=8,
    )
    assert _generate(llm) == _resident(path, "mixtral", quantization)
    stats = _stats(llm)
    assert stats.waves > 0 and stats.prefetch_loads > 0 and stats.streamed_layers == 0


def test_a_failed_load_empties_its_slot(tiny_model_dir: Callable[[str], str]) -> None:
    """A load that raises surfaces in the step, and its expert is not left resident on
    whatever the slot held: the next step loads it again and computes the resident result."""
    path = tiny_model_dir("mixtral")
    model, _ = load_model(path, torch.float32, expert_offload=ExpertOffloadOptions("disk", cache_size=2))
    resident, _ = load_model(path, torch.float32)
    layer = next(m for m in model.modules() if isinstance(m, OffloadedExperts))
    block = next(m for m in resident.modules() if isinstance(m, SparseMoeBlock))
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    weights, ids = block.route(x)
    failing = int(ids[0, 0])
    source = layer.sources[failing]

    class Broken(ExpertSource):
        def copy_into(self, tensors: dict[str, torch.Tensor], non_blocking: bool = False) -> int:
            raise OSError("read failed")

    layer.sources[failing] = Broken(source.copies)
    with pytest.raises(OSError, match="read failed"):
        layer(x, weights, ids)
    assert layer.cache.resident(failing) is None
    layer.sources[failing] = source
    assert torch.equal(layer(x, weights, ids), block.grouped_experts(x, weights, ids))


def test_host_on_cpu_binds_slots_to_the_host_experts(tiny_model_dir: Callable[[str], str]) -> None:
    """On a CPU device a host load copies nothing: every slot tensor is one of the experts'
    host tensors, so the slots hold no memory of their own."""
    path = tiny_model_dir("mixtral")
    model, _ = load_model(path, torch.float32, expert_offload=ExpertOffloadOptions("host", cache_size=2))
    for layer in (m for m in model.modules() if isinstance(m, OffloadedExperts)):
        owned = {c.src.data_ptr() for s in layer.sources for c in s.copies}
        for slot in layer.slots:
            assert {t.data_ptr() for t in slot_tensors(slot).values()} <= owned


def test_expert_options_need_an_offload_mode(tiny_model_dir: Callable[[str], str]) -> None:
    """A cache size without an offload mode is a mistake, said so rather than ignored."""
    with pytest.raises(ValueError, match="need expert_offload"):
        make_llm(tiny_model_dir("mixtral"), expert_cache_size=2)


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_a_recorded_trace_replays_to_the_engines_counts(policy: str, tiny_model_dir: Callable[[str], str]) -> None:
    """The routing each layer saw while serving, replayed (cache.replay, no weights)
    through a copy of the layer's cache as it stood before (the start-up warm-up left
    experts in it), gives the engine's hits and misses: the engine's cache decisions are
    the schedule's, nothing else."""
    path = tiny_model_dir("mixtral")
    llm = make_llm(
        path,
        max_num_seqs=16,
        expert_offload="disk",
        expert_cache_size=3,
        expert_cache_policy=policy,
        expert_stream_threshold=8,
        expert_prefetch=False,
    )
    layers = _offloaded_layers(llm)
    caches = [copy.deepcopy(layer.cache) for layer in layers]
    traces: list[list[list[int]]] = [[] for _ in layers]
    for layer, trace in zip(layers, traces):
        record = layer.cache.policy.record

        def recording(
            experts: Iterable[int], record: Callable[[Iterable[int]], None] = record, trace: list[list[int]] = trace
        ) -> None:
            trace.append(list(experts))
            record(experts)

        layer.cache.policy.record = recording  # type: ignore[method-assign]
    before = _stats(llm).snapshot()
    _generate(llm)
    served = _stats(llm).snapshot().minus(before)
    replayed = [replay(trace, cache) for trace, cache in zip(traces, caches)]
    assert sum(len(t) for t in traces) > 0
    assert served.hits == sum(r.hits for r in replayed) > 0
    assert served.misses == sum(r.misses for r in replayed) > 0


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["host", "disk"])
def test_cuda_offload_matches_resident(mode: str, tiny_model_dir: Callable[[str], str]) -> None:
    """On a GPU: int8 experts take the grouped path resident too, so offloaded tokens
    (side-stream copies, from pinned host memory or the mapped file) are the resident
    ones; dense experts, also with cold ones run on the CPU, give the resident logits
    to rounding (resident runs them through the fused kernel)."""
    path = tiny_model_dir("mixtral")
    options = dict(device="cuda", max_num_seqs=16, quantization="int8")
    resident = _generate(make_llm(path, **options))
    offloaded = make_llm(path, expert_offload=mode, expert_cache_size=3, expert_stream_threshold=8, **options)
    assert _generate(offloaded) == resident
    stats = _stats(offloaded)
    assert stats.load_bytes > 0 and stats.prefetch_loads > 0 and stats.waves > 0
    ids = torch.tensor(PROMPTS[15], device="cuda")
    dense, _ = load_model(path, torch.float32, "cuda")
    for cpu_compute in (False, True):
        offload = ExpertOffloadOptions(mode, cache_size=3, cpu_compute=cpu_compute)
        model, _ = load_model(path, torch.float32, "cuda", expert_offload=offload)
        ctx: Any = VarlenSdpaContext(model.attention_spec(), [ids.numel()])  # the paged backend's stand-in
        positions = torch.arange(ids.numel(), device="cuda")
        with torch.no_grad():
            got = model.compute_logits(model(ids, positions, ctx))
            want = dense.compute_logits(dense(ids, positions, ctx))
        assert rel_err(got, want) < 1e-5


def test_slots_keep_no_copy_of_weights_a_load_replaces(tiny_model_dir: Callable[[str], str]) -> None:
    """A held CPU kernel's copy (dense, half, integer) is made from the weights once; a
    slot's weights change at every load, so the planner gives slots none of those
    kernels, even where --cpu-kernels names one, and the tokens do not depend on what a
    slot held before (one slot per layer against four)."""
    path = tiny_model_dir("mixtral")
    options = {"quantization": "int4", "cpu_kernels": "dense", "expert_offload": "disk"}
    tight = make_llm(path, max_num_seqs=16, expert_cache_size=1, **options)
    tokens = _generate(tight)
    kernels = [(m, m.cpu_kernel) for m in tight.engine.model.modules() if isinstance(m, LinearLayer) and m.cpu_kernel]
    slots = [(m, kernel) for m, kernel in kernels if not m.weights_fixed]
    assert slots and any(m.weights_fixed and kernel == "dense" for m, kernel in kernels)
    for layer, kernel in slots:
        assert kernel not in HELD_KERNELS, layer.prefix
        assert layer.cpu_dense is None and not layer.cpu_half and not layer.cpu_int_dot
    roomy = make_llm(path, max_num_seqs=16, expert_cache_size=4, **options)
    assert _generate(roomy) == tokens
