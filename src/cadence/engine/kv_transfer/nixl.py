"""KV transfer over NIXL, the transfer library vLLM, SGLang and Dynamo use.

Each engine owns one NIXL agent with the UCX backend and registers its cache tensors
with it (host memory as DRAM, CUDA tensors as VRAM, so UCX can move GPU memory without
staging). A prefill engine's address carries its agent's metadata and, per tensor, where
each block lies; a decode engine adds that agent once and reads blocks with one-sided
READs, so the prefill side does nothing per transfer and learns nothing of it.

Why a cancelled load is reported only once NIXL says its transfer ended: releasing an
active NIXL request makes UCX cancel and free its operations, but UCX cannot withdraw an
RMA read already in flight (NIXL's own UCX backend says cancelling "may not be enough"),
so a released transfer could still write into blocks the scheduler is about to reuse.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch
from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_xfer_handle

from cadence.engine.attention.backend import KVCache, split_kv_cache
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.kv_transfer.transport import KVTransport
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult

# Raised by NIXL when the peer's process or connection is gone; the bindings carry no
# type information, hence the lookup.
_RemoteDisconnect: type[Exception] = getattr(
    importlib.import_module("nixl_cu12._bindings"), "nixlRemoteDisconnectError", RuntimeError
)
# How long `close` lets transfers still in flight end before it releases them anyway.
_CLOSE_WAIT_S = 2.0


@dataclass(frozen=True)
class _Region:
    """One registered cache tensor (values or scales of a layer), as a reader needs it:
    `halves` regions (keys, values) `half_stride` bytes apart, each `num_blocks` blocks
    of `block_bytes` bytes, `block_stride` bytes apart."""

    base: int
    halves: int
    half_stride: int
    num_blocks: int
    block_stride: int
    block_bytes: int
    device: int

    @staticmethod
    def of(tensor: torch.Tensor) -> _Region:
        if tensor.dim() < 2 or not tensor.is_contiguous():
            raise ValueError("NIXL registers contiguous [2, num_blocks, ...] KV tensors only")
        size = tensor.element_size()
        return _Region(
            tensor.data_ptr(),
            tensor.shape[0],
            tensor.stride(0) * size,
            tensor.shape[1],
            tensor.stride(1) * size,
            tensor[0, 0].numel() * size,
            tensor.device.index or 0,
        )


@dataclass(frozen=True)
class _Memory:
    """An engine's registered caches: their NIXL memory type and regions, in the order
    of `_tensors`."""

    kind: str  # "DRAM" or "VRAM"
    regions: tuple[_Region, ...]


@dataclass(frozen=True)
class _Remote:
    agent: str
    memory: _Memory


@dataclass
class _Pending:
    request_id: str
    handle: nixl_xfer_handle
    num_blocks: int
    address: str
    cancelled: bool = False


def _tensors(kv_caches: list[KVCache]) -> list[torch.Tensor]:
    """Every tensor of every layer: values, then scales where the cache is quantized."""
    return [tensor for cache in kv_caches for tensor in split_kv_cache(cache) if tensor is not None]


def _memory_of(tensors: list[torch.Tensor]) -> _Memory:
    kind = "VRAM" if tensors and tensors[0].device.type == "cuda" else "DRAM"
    return _Memory(kind, tuple(_Region.of(tensor) for tensor in tensors))


def _runs(first: list[int], second: list[int], merge: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The first blocks on each side and the lengths of runs of blocks that follow each
    other on both sides: a run is one descriptor, which matters, since each descriptor
    costs UCX a separate operation (a system call each with CMA on one host)."""
    a, b = np.asarray(first, dtype=np.int64), np.asarray(second, dtype=np.int64)
    if merge:
        starts = np.concatenate([[0], np.flatnonzero((np.diff(a) != 1) | (np.diff(b) != 1)) + 1])
    else:
        starts = np.arange(len(a))
    lengths = np.diff(np.append(starts, len(a)))
    return a[starts], b[starts], lengths


def _descriptors(memory: _Memory, first_blocks: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """(address, bytes, device) of each run of blocks of each half of each tensor,
    tensor-major: the same order on both sides, so local row i receives remote row i."""
    rows = []
    for region in memory.regions:
        for half in range(region.halves):
            start = region.base + half * region.half_stride
            addresses = start + first_blocks * region.block_stride
            rows.append(np.stack([addresses, lengths * region.block_bytes, np.full_like(lengths, region.device)], 1))
    return np.concatenate(rows).astype(np.uint64) if rows else np.zeros((0, 3), dtype=np.uint64)


def _mismatch(local: _Memory, remote: _Memory, load: KVLoad) -> str | None:
    """Why the load's blocks cannot be read between these two caches, or None."""
    if len(local.regions) != len(remote.regions):
        return f"the source has {len(remote.regions)} KV tensors, this engine {len(local.regions)}"
    for index, (ours, theirs) in enumerate(zip(local.regions, remote.regions)):
        if (ours.halves, ours.block_bytes) != (theirs.halves, theirs.block_bytes):
            return f"KV tensor {index}: the source's blocks are not shaped like this engine's"
    if len(load.remote_block_ids) != len(load.local_block_ids):
        return "the load names different numbers of source and target blocks"
    for memory, ids, whose in ((remote, load.remote_block_ids, "the source"), (local, load.local_block_ids, "here")):
        if any(not 0 <= block < region.num_blocks for region in memory.regions for block in ids):
            return f"the load names blocks that do not exist {whose}"
    return None


class NixlTransport(KVTransport):
    """Blocks read from other engines' registered memory by NIXL (UCX), in or across
    processes and hosts."""

    name = "nixl"

    def __init__(self, exporting: bool = True) -> None:
        # An exporter needs NIXL's progress thread: UCX must answer a reader's connection
        # setup (and, over TCP, its reads) while the engine sits idle holding KV. A reader
        # goes without: its `check_xfer_state` calls progress its own transfers, and the
        # engine keeps stepping while loads are in flight.
        self.exporting = exporting
        self.agent_name = f"cadence-{os.getpid()}-{uuid.uuid4().hex}"
        config = nixl_agent_config(enable_prog_thread=exporting, backends=["UCX"])
        threads = _threads()
        self._agent: nixl_agent | None = nixl_agent(self.agent_name, config)
        # The progress thread polls without sleeping (the Python API fixes its delay at
        # 0), which would take a core from the model's CPU threads; at the lowest
        # priority it runs on the CPU time they leave. The threads are the ones the agent
        # started (Linux: a thread id is a `setpriority` target).
        for thread in _threads() - threads:
            _quietly(lambda tid=thread: os.setpriority(os.PRIO_PROCESS, tid, 19))
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL could not create its UCX backend")
        self._registered: Any = None  # the nixlRegDList of our caches
        self._held: list[torch.Tensor] = []  # kept alive while registered: readers may be reading them
        self._local: _Memory | None = None
        self._remotes: dict[str, _Remote] = {}  # address -> added agent
        self._pending: list[_Pending] = []
        self._results: list[KVLoadResult] = []

    @property
    def agent(self) -> nixl_agent:
        if self._agent is None:
            raise RuntimeError("the NIXL transport is closed")
        return self._agent

    def export(self, kv_caches: list[KVCache], layout: KVLayout) -> KVSource:
        if not self.exporting:
            raise ValueError("this NIXL transport was made for reading only (no progress thread)")
        memory = self._register(kv_caches)
        address = {
            "agent": self.agent_name,
            "metadata": base64.b64encode(self.agent.get_agent_metadata()).decode(),
            "kind": memory.kind,
            "regions": [asdict(region) for region in memory.regions],
        }
        return KVSource(self.name, json.dumps(address), layout)

    def start_load(self, load: KVLoad, kv_caches: list[KVCache]) -> None:
        if not load.local_block_ids and not load.remote_block_ids:
            self._results.append(KVLoadResult(load.request_id, 0))
            return
        source = load.source
        if not isinstance(source, KVSource) or source.transport != self.name:
            self._results.append(KVLoadResult(load.request_id, 0, f"not a NIXL source: {source!r}"))
            return
        handle = None
        try:
            local = self._register(kv_caches)
            remote = self._remote(source.address)
            problem = _mismatch(local, remote.memory, load)
            if problem is not None:
                self._results.append(KVLoadResult(load.request_id, 0, problem))
                return
            agent = self.agent
            # Runs of blocks merge only where blocks lie back to back in every tensor.
            merge = all(r.block_stride == r.block_bytes for r in local.regions + remote.memory.regions)
            ours, theirs, lengths = _runs(load.local_block_ids, load.remote_block_ids, merge)
            local_descs = agent.get_xfer_descs(_descriptors(local, ours, lengths), local.kind)
            remote_descs = agent.get_xfer_descs(_descriptors(remote.memory, theirs, lengths), remote.memory.kind)
            handle = agent.initialize_xfer("READ", local_descs, remote_descs, remote.agent)
            if agent.transfer(handle) == "ERR":
                raise RuntimeError("NIXL refused to post the transfer")
        except Exception as error:  # noqa: BLE001 - NIXL's errors share no base; any is this load's
            # Nothing was posted, or NIXL failed the post: no byte will arrive.
            if handle is not None:
                self._release(handle)
            self._forget_if_lost(source.address)
            self._results.append(KVLoadResult(load.request_id, 0, f"NIXL load failed: {_describe(error)}"))
            return
        self._pending.append(_Pending(load.request_id, handle, len(load.local_block_ids), source.address))

    def cancel(self, request_id: str) -> None:
        for pending in self._pending:
            if pending.request_id == request_id:
                pending.cancelled = True  # reported when NIXL says the transfer ended

    def poll(self) -> list[KVLoadResult]:
        results, self._results = self._results, []
        still: list[_Pending] = []
        for pending in self._pending:
            result = self._check(pending)
            if result is None:
                still.append(pending)
            else:
                results.append(result)
        self._pending = still
        return results

    def close(self) -> None:
        if self._agent is None:
            return
        # Let transfers in flight end first: a released one may still be writing.
        deadline = time.monotonic() + _CLOSE_WAIT_S
        while self._pending and time.monotonic() < deadline:
            self.poll()
        for pending in self._pending:
            self._release(pending.handle)
        self._pending = []
        for remote in self._remotes.values():
            _quietly(lambda name=remote.agent: self.agent.remove_remote_agent(name))
        self._remotes.clear()
        if self._registered is not None:
            _quietly(lambda: self.agent.deregister_memory(self._registered))
            self._registered = None
        self._local, self._held = None, []
        self._agent = None

    def _register(self, kv_caches: list[KVCache]) -> _Memory:
        """Our caches' regions, registered with the agent the first time we see them."""
        tensors = _tensors(kv_caches)
        memory = _memory_of(tensors)
        if self._local is None:
            self._registered = self.agent.register_memory(tensors)
            self._local, self._held = memory, tensors
        elif self._local != memory:
            raise ValueError("the KV caches are not the tensors registered with NIXL")
        return self._local

    def _remote(self, address: str) -> _Remote:
        """The exporting agent of `address`, added to ours on first use."""
        remote = self._remotes.get(address)
        if remote is None:
            fields = json.loads(address)
            memory = _Memory(fields["kind"], tuple(_Region(**region) for region in fields["regions"]))
            self.agent.add_remote_agent(base64.b64decode(fields["metadata"]))
            remote = self._remotes[address] = _Remote(fields["agent"], memory)
        return remote

    def _check(self, pending: _Pending) -> KVLoadResult | None:
        """The load's result once its transfer ended, else None."""
        try:
            state = self.agent.check_xfer_state(pending.handle)
            error = "NIXL reported the transfer failed" if state == "ERR" else None
        except Exception as raised:  # noqa: BLE001 - a dead peer raises; it must end the load, not the step
            state, error = "ERR", _describe(raised)
        if state == "PROC":
            return None
        self._release(pending.handle)
        if error is not None:
            self._forget_if_lost(pending.address)
            # NIXL does not say which descriptors landed, so no block counts as loaded.
            return KVLoadResult(pending.request_id, 0, f"NIXL load failed: {error}")
        if pending.cancelled:
            return KVLoadResult(pending.request_id, 0, "cancelled")
        return KVLoadResult(pending.request_id, pending.num_blocks)

    def _forget_if_lost(self, address: str) -> None:
        """Drop an added agent that NIXL no longer knows (it drops a disconnected peer's
        metadata), so the next load from that address adds it again."""
        remote = self._remotes.get(address)
        if remote is not None and not _quietly(lambda: self.agent.check_remote_metadata(remote.agent)):
            del self._remotes[address]

    def _release(self, handle: nixl_xfer_handle) -> None:
        # A handle NIXL cannot free now is kept by the handle itself and freed with the agent.
        _quietly(lambda: self.agent.release_xfer_handle(handle))


def _threads() -> set[int]:
    """This process's thread ids (none where /proc does not list them)."""
    return {int(tid) for tid in os.listdir("/proc/self/task")} if os.path.isdir("/proc/self/task") else set()


def _describe(error: Exception) -> str:
    if isinstance(error, _RemoteDisconnect):
        return f"the source engine disconnected ({error})"
    return f"{type(error).__name__}: {error}"


def _quietly(call: Any) -> Any:
    """Run a NIXL call whose failure changes nothing for us (cleanup, probes); None if it raised."""
    try:
        return call()
    except Exception:  # noqa: BLE001 - best effort by design
        return None
