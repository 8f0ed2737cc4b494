"""KV transfer between engine processes on one host, through anonymous shared memory.

The prefill engine's KV tensors live in memfds (`os.memfd_create`: memory files with no
name in any file system), mapped shared: the engine computes into them as into any
tensor, and a decode engine in another process maps the same memory read-only and copies
the blocks it is told to. Nothing is sent per load but block ids.

Why memfds and not files in /dev/shm: a tmpfs file lives until someone unlinks it, and a
process killed by SIGKILL (the OOM killer, a node drain) unlinks nothing, so each crash
left its KV cache's size of RAM behind for good. The kernel frees a memfd when its last
descriptor and mapping go, so once every process that used one has ended, in whatever
way, nothing is left. (Nor does the size of /dev/shm, small in many containers, bound
the cache.)

How a reader reaches the memory: the exporter keeps each memfd open, and its address
names the exporter's pid and start time and, per tensor, the descriptor's number and the
memfd's name (`cadence-kv-<pid>-<uuid>-<n>`: unique, so it identifies the memfd). A reader
opens `/proc/<pid>/fd/<fd>`, which Linux allows a process of the same user that sees the
exporter's pid (one host, and one container or a shared pid namespace), checks that what
it opened is that memfd, maps it and closes the descriptor.

A mapping outlives its exporter: the memory stays readable, and allocated, while a reader
maps it. So before each load a reader checks that the exporter is still the same live
process (pid and start time: a reused pid is another process) and still holds those
memfds (closing the transport closes them); otherwise the load is an error, never a read
of what a dead engine left. Mappings of exporters that ended are dropped at every load, so
their memory goes at the reader's next load from any source, or when it ends.

Only CPU caches can be shared this way, and only an exporting (prefill) engine's caches
are memfds; a reader's own caches are plain tensors.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import math
import os
import re
import uuid
import weakref
from dataclasses import dataclass

import torch

from cadence.engine.attention.backend import KVCache, QuantizedKVCache, split_kv_cache
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.process_identity import own_start_time, start_time
from cadence.engine.kv_transfer.read_only_mapping import map_read_only
from cadence.engine.kv_transfer.source import KVSource
from cadence.engine.kv_transfer.transport import SynchronousTransport, copy_blocks
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult

_SCHEME = "shm:"
_PREFIX = re.compile(r"cadence-kv-\d+-[0-9a-f]{32}")


@dataclass(frozen=True)
class _Exported:
    """One tensor this transport allocated: its memfd (number in the name, descriptor)."""

    number: int
    fd: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True)
class _RemoteTensor:
    """One exported tensor as a reader finds it: the exporter's descriptor for it, the
    memfd's name, and how to read its bytes."""

    path: str  # /proc/<pid>/fd/<fd>
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    def is_named_by(self, link: str) -> bool:
        """Whether a /proc fd link is this memfd (a memfd has no path: /proc shows its name)."""
        return link in (f"/memfd:{self.name} (deleted)", f"/memfd:{self.name}")


@dataclass(frozen=True)
class _Address:
    """A decoded address: which process exported the tensors, and the tensors."""

    pid: int
    start: int
    tensors: tuple[_RemoteTensor, ...]


@dataclass
class _Mapping:
    """A source as this process mapped it, and the address it came from."""

    address: _Address
    tensors: list[torch.Tensor]


class _LoadError(Exception):
    """Why a load cannot be read; it becomes the load's error, never an exception."""


def _flat(kv_caches: list[KVCache]) -> list[torch.Tensor]:
    """Every tensor of the caches in `split_kv_cache` order: values, then any scales."""
    return [tensor for cache in kv_caches for tensor in split_kv_cache(cache) if tensor is not None]


def _close_all(fds: list[int]) -> None:
    """Close the memfds (our own mappings of them stay valid; readers find them gone)."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    fds.clear()


def encode_address(pid: int, start: int, prefix: str, tensors: list[_Exported]) -> str:
    """`shm:` and compact JSON: the exporting process, the memfds' name prefix, and per
    tensor its number, descriptor, dtype and shape. A plain str, so it crosses processes
    in any message."""
    described = [[t.number, t.fd, str(t.dtype).removeprefix("torch."), list(t.shape)] for t in tensors]
    data = {"pid": pid, "start": start, "prefix": prefix, "tensors": described}
    return _SCHEME + json.dumps(data, separators=(",", ":"))


def decode_address(address: str) -> _Address:
    """The tensors of an address, refusing anything that is not one of ours (an address
    names descriptors this process will open)."""
    try:
        if not address.startswith(_SCHEME):
            raise ValueError(f"not a {_SCHEME} address")
        data = json.loads(address.removeprefix(_SCHEME))
        pid, start, prefix = int(data["pid"]), int(data["start"]), str(data["prefix"])
        if pid <= 0 or not _PREFIX.fullmatch(prefix):
            raise ValueError(f"unexpected process {pid} or name prefix {prefix!r}")
        tensors = []
        for number, fd, dtype_name, shape in data["tensors"]:
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype_name!r}")
            if int(fd) < 0 or int(number) < 0:
                raise ValueError(f"bad descriptor {fd} or number {number}")
            path = f"/proc/{pid}/fd/{int(fd)}"
            tensors.append(_RemoteTensor(path, f"{prefix}-{int(number)}", dtype, tuple(map(int, shape))))
        return _Address(pid, start, tuple(tensors))
    except (ValueError, KeyError, TypeError) as error:
        raise _LoadError(f"unreadable shared-memory address {address[:80]!r}: {error}") from error


def _gone(address: _Address) -> str | None:
    """Why the source can no longer be read, or None: its exporter ended (a live process
    with its pid and another start time is not it), or closed its transport."""
    if start_time(address.pid) != address.start:
        return f"the exporting process {address.pid} has ended"
    for tensor in address.tensors:
        try:
            link = os.readlink(tensor.path)
        except OSError:
            link = ""
        if not tensor.is_named_by(link):
            return f"process {address.pid} no longer holds {tensor.name}: its transport closed"
    return None


def _map_source_tensor(tensor: _RemoteTensor) -> torch.Tensor:
    """The memfd as a tensor over a read-only shared mapping.

    Shared (not private) so that blocks written after the mapping was made are seen;
    read-only so that nothing here can write into another engine's cache (a stray write
    faults instead of corrupting it). Opened without blocking, and then checked by what
    this process holds (not the exporter's path again, which could have changed since):
    a descriptor that is not the memfd is never mapped."""
    nbytes = tensor.dtype.itemsize * math.prod(tensor.shape)
    fd = os.open(tensor.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not tensor.is_named_by(os.readlink(f"/proc/self/fd/{fd}")):
            raise _LoadError(f"{tensor.path} is not {tensor.name}")
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise _LoadError(f"{tensor.name} holds {size} bytes, its address says {nbytes}")
        raw = map_read_only(fd, nbytes)
    finally:
        os.close(fd)  # the mapping holds the memory by itself
    return raw.view(tensor.dtype).view(tensor.shape)


class SharedMemoryTransport(SynchronousTransport):
    """KV caches in memfds that engine processes on one host map and read."""

    name = "shared-memory"

    def __init__(self, exporting: bool = True) -> None:
        self.exporting = exporting
        self.prefix = f"cadence-kv-{os.getpid()}-{uuid.uuid4().hex}"
        # Our memfds, by the address of their tensor's first byte (how `export` finds them).
        self._exported: dict[int, _Exported] = {}
        self._numbers = itertools.count()
        self._fds: list[int] = []  # still open
        self._mappings: dict[str, _Mapping] = {}  # sources read from, by address
        super().__init__()
        # A dropped transport closes its memfds too: the list, not `self`, is held.
        self._finalizer = weakref.finalize(self, _close_all, self._fds)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed tensor in a new memfd, mapped shared.

        Its pages are reserved before it is mapped: too little memory is an error here,
        not a SIGBUS at some later write."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"the shared-memory KV transport holds CPU caches only, not {device}")
        if not self.exporting:  # a reader's caches are its own business
            return torch.zeros(shape, dtype=dtype, device=device)
        if not hasattr(os, "memfd_create"):
            raise OSError("the shared-memory KV transport needs Linux (memfd_create and /proc)")
        numel = math.prod(shape)
        if numel == 0:
            raise ValueError("an empty KV tensor cannot be shared")
        number = next(self._numbers)
        nbytes = numel * dtype.itemsize
        fd = os.memfd_create(f"{self.prefix}-{number}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as error:
                raise OSError(
                    error.errno, f"cannot reserve {nbytes} bytes of shared memory for a KV tensor: {error.strerror}"
                ) from error
            # Its size is fixed for good: a reader's mapping of a file that shrank would
            # fault on read, and a reader trusts the size it checked once.
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            # Mapped through a path of its own: `mmap.mmap` would keep a second descriptor.
            tensor = torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=numel, dtype=dtype)
        except BaseException:
            os.close(fd)
            raise
        self._fds.append(fd)
        self._exported[tensor.data_ptr()] = _Exported(number, fd, dtype, tuple(shape))
        return tensor.view(shape)

    def export(self, kv_caches: list[KVCache], layout: KVLayout) -> KVSource:
        tensors = []
        for tensor in _flat(kv_caches):
            entry = self._exported.get(tensor.data_ptr())
            if entry is None or entry.shape != tuple(tensor.shape) or entry.dtype != tensor.dtype:
                raise ValueError("a KV tensor to export was not allocated whole by this transport's zeros()")
            tensors.append(entry)
        address = encode_address(os.getpid(), own_start_time(), self.prefix, tensors)
        return KVSource(self.name, address, layout)

    def start_load(self, load: KVLoad, kv_caches: list[KVCache]) -> None:
        try:
            if not isinstance(load.source, KVSource) or load.source.transport != self.name:
                raise _LoadError(f"not a {self.name} source: {load.source!r}")
            self._drop_ended()
            source = self._source(load.source.address)
            self._check(source, kv_caches, load)
        except _LoadError as error:
            self._results.append(KVLoadResult(load.request_id, 0, str(error)))
            return
        copy_blocks(_like(kv_caches, source), kv_caches, load.remote_block_ids, load.local_block_ids)
        self._results.append(KVLoadResult(load.request_id, len(load.local_block_ids)))

    def _drop_ended(self) -> None:
        """Unmap every source whose exporter ended: this process may be the last holder
        of its memory, and no load will read it again."""
        for address, mapping in list(self._mappings.items()):
            if start_time(mapping.address.pid) != mapping.address.start:
                del self._mappings[address]

    def _source(self, address: str) -> list[torch.Tensor]:
        """The source's tensors, mapped on first use; refused once its exporter is gone."""
        mapping = self._mappings.get(address)
        if mapping is not None:
            reason = _gone(mapping.address)
            if reason is not None:
                del self._mappings[address]
                raise _LoadError(f"the source is gone: {reason}")
            return mapping.tensors
        parsed = decode_address(address)
        # Checked before anything is opened: another process's descriptors are not ours to open.
        reason = _gone(parsed)
        if reason is not None:
            raise _LoadError(f"cannot open the source: {reason}")
        try:
            tensors = [_map_source_tensor(tensor) for tensor in parsed.tensors]
        except (OSError, ValueError) as error:
            raise _LoadError(f"cannot open the source's memory (its engine closed or died?): {error}") from error
        self._mappings[address] = _Mapping(parsed, tensors)
        return tensors

    @staticmethod
    def _check(source: list[torch.Tensor], kv_caches: list[KVCache], load: KVLoad) -> None:
        """Refuse, before anything is written, a source that is not laid out like our
        caches (the number of blocks may differ) or block ids outside either."""
        target = _flat(kv_caches)
        if len(source) != len(target):
            raise _LoadError(f"the source has {len(source)} KV tensors, this engine {len(target)}")
        for index, (theirs, ours) in enumerate(zip(source, target)):
            if theirs.dtype != ours.dtype or theirs.shape[:1] + theirs.shape[2:] != ours.shape[:1] + ours.shape[2:]:
                raise _LoadError(
                    f"KV tensor {index}: the source's {theirs.dtype} {tuple(theirs.shape)} "
                    f"does not fit this engine's {ours.dtype} {tuple(ours.shape)}"
                )
        if len(load.remote_block_ids) != len(load.local_block_ids):
            raise _LoadError(f"{len(load.remote_block_ids)} source blocks for {len(load.local_block_ids)} here")
        for ids, tensors, side in ((load.remote_block_ids, source, "source"), (load.local_block_ids, target, "local")):
            if ids and tensors and not all(0 <= i < tensors[0].shape[1] for i in ids):
                raise _LoadError(f"{side} block ids out of range 0..{tensors[0].shape[1] - 1}: {ids}")

    def close(self) -> None:
        """Close our memfds (our own tensors stay usable; readers find the source gone)
        and unmap the sources we read."""
        _close_all(self._fds)
        self._mappings.clear()


def _like(kv_caches: list[KVCache], flat: list[torch.Tensor]) -> list[KVCache]:
    """Flat source tensors regrouped into caches shaped like ours (checked to fit)."""
    caches: list[KVCache] = []
    position = 0
    for cache in kv_caches:
        if isinstance(cache, QuantizedKVCache):
            caches.append(QuantizedKVCache(flat[position], flat[position + 1]))
            position += 2
        else:
            caches.append(flat[position])
            position += 1
    return caches
