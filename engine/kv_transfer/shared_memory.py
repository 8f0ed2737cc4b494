"""KV transfer between engine processes on one host, through files in /dev/shm.

The prefill engine's KV tensors live in files of a tmpfs, mapped shared: the engine
computes into them as into any tensor, and a decode engine in another process maps the
same files read-only and copies the blocks it is told to. Nothing is sent per load but
block ids; the bytes are read straight out of the page cache both processes share. A
reader keeps its mappings, and before each load checks that the files are still the ones
it mapped (a stat each): a mapping outlives its file, so without the check a source whose
engine closed would go on being read instead of reported gone.

Files are named `<directory>/cadence-kv-<pid>-<uuid>-<n>` (one per tensor, `n` counting
from 0 in allocation order). `close()`, object finalization and a normal interpreter exit
unlink them; a prefill process that is SIGKILLed (or ends by a signal Python does not
handle, or by `os._exit` as in a forked multiprocessing child) leaves them behind. They
can be found by that pattern and removed once process `<pid>` is gone; they take memory
until then, since tmpfs pages are RAM.

Only CPU caches can be shared this way. Only an exporting (prefill) engine's transport
allocates its caches in the tmpfs, so the tmpfs must hold the caches of the prefill
engines on the host (container runtimes often mount a small /dev/shm: its size bounds
their KV cache). `remove_source_files` removes a dead exporter's files, given its source.
"""

from __future__ import annotations

import itertools
import json
import math
import mmap
import os
import re
import uuid
import warnings
import weakref
from dataclasses import dataclass

import torch

from cadence.engine.attention.backend import KVCache, QuantizedKVCache, split_kv_cache
from cadence.engine.kv_transfer.layout import KVLayout
from cadence.engine.kv_transfer.transport import KVSource, SynchronousTransport, copy_blocks
from cadence.scheduler.remote_kv import KVLoad, KVLoadResult

_SCHEME = "shm:"
_PREFIX = re.compile(r"cadence-kv-\d+-[0-9a-f]{32}")


@dataclass(frozen=True)
class _TensorFile:
    """One exported tensor: the file it lies in, whole and contiguous, and how to read it."""

    path: str
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class _Mapping:
    """A source's files as this process mapped them, and which files they were: a file
    unlinked or replaced since means its engine closed or died."""

    files: list[_TensorFile]
    tensors: list[torch.Tensor]
    identities: list[tuple[int, int]]  # (st_dev, st_ino) per file


class _LoadError(Exception):
    """Why a load cannot be read; it becomes the load's error, never an exception."""


def _flat(kv_caches: list[KVCache]) -> list[torch.Tensor]:
    """Every tensor of the caches in `split_kv_cache` order: values, then any scales."""
    return [tensor for cache in kv_caches for tensor in split_kv_cache(cache) if tensor is not None]


def _unlink_all(paths: list[str]) -> None:
    """Remove the files (a mapping of one stays valid until it is dropped)."""
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    paths.clear()


def encode_address(directory: str, prefix: str, files: list[tuple[int, torch.dtype, tuple[int, ...]]]) -> str:
    """`shm:` and compact JSON: the folder, the prefix, and per tensor its file number,
    dtype and shape. A plain str, so it crosses processes in any message."""
    tensors = [[n, str(dtype).removeprefix("torch."), list(shape)] for n, dtype, shape in files]
    return _SCHEME + json.dumps({"directory": directory, "prefix": prefix, "tensors": tensors}, separators=(",", ":"))


def decode_address(address: str) -> list[_TensorFile]:
    """The files of an address, refusing anything that is not one of ours (an address
    names paths this process will open)."""
    try:
        if not address.startswith(_SCHEME):
            raise ValueError(f"not a {_SCHEME} address")
        data = json.loads(address.removeprefix(_SCHEME))
        directory, prefix = str(data["directory"]), str(data["prefix"])
        if not _PREFIX.fullmatch(prefix):
            raise ValueError(f"unexpected file prefix {prefix!r}")
        files = []
        for n, dtype_name, shape in data["tensors"]:
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"unknown dtype {dtype_name!r}")
            files.append(_TensorFile(os.path.join(directory, f"{prefix}-{int(n)}"), dtype, tuple(map(int, shape))))
        return files
    except (ValueError, KeyError, TypeError) as error:
        raise _LoadError(f"unreadable shared-memory address {address[:80]!r}: {error}") from error


def _map_read_only(file: _TensorFile) -> tuple[torch.Tensor, tuple[int, int]]:
    """The file as a tensor over a read-only shared mapping, and the file's identity.

    Shared (not private) so that blocks written after the mapping was made are seen;
    read-only so that nothing here can write into another engine's cache (a stray write
    faults instead of corrupting it) and a missing file is not created."""
    with open(file.path, "rb") as handle:
        stat = os.fstat(handle.fileno())
        nbytes = file.dtype.itemsize * math.prod(file.shape)
        if stat.st_size != nbytes:
            raise _LoadError(f"{file.path} holds {stat.st_size} bytes, its address says {nbytes}")
        buffer = mmap.mmap(handle.fileno(), nbytes, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "not writable": that is the point
        raw = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the mapping alive
    return raw.view(file.dtype).view(file.shape), (stat.st_dev, stat.st_ino)


class SharedMemoryTransport(SynchronousTransport):
    """KV caches in tmpfs files that engine processes on one host map and read."""

    name = "shared-memory"

    def __init__(self, directory: str = "/dev/shm", exporting: bool = True) -> None:
        self.directory = directory
        self.exporting = exporting
        self.prefix = f"cadence-kv-{os.getpid()}-{uuid.uuid4().hex}"
        # Our files, by the address of their tensor's first byte (how `export` finds them).
        self._files: dict[int, tuple[int, torch.dtype, tuple[int, ...]]] = {}
        self._numbers = itertools.count()
        self._paths: list[str] = []  # still to unlink
        self._mappings: dict[str, _Mapping] = {}  # sources read from, by address
        super().__init__()
        # Also at exit or when the transport is collected: the list, not `self`, is held.
        self._finalizer = weakref.finalize(self, _unlink_all, self._paths)

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A zeroed tensor in a new file of the tmpfs, mapped shared.

        The file's pages are reserved before it is mapped: a full tmpfs is an error here,
        where a sparse file would have killed the process with SIGBUS on a later write."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"the shared-memory KV transport holds CPU caches only, not {device}")
        if not self.exporting:  # a reader's caches are its own business
            return torch.zeros(shape, dtype=dtype, device=device)
        numel = math.prod(shape)
        if numel == 0:
            raise ValueError("an empty KV tensor cannot be shared")
        n = next(self._numbers)
        path = os.path.join(self.directory, f"{self.prefix}-{n}")
        nbytes = numel * dtype.itemsize
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)  # a new file: zeros
        self._paths.append(path)
        try:
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, nbytes)
            else:
                os.ftruncate(fd, nbytes)
        except OSError as error:
            _unlink_all([self._paths.pop()])
            raise OSError(
                error.errno, f"cannot reserve {nbytes} bytes for a KV tensor in {self.directory}: {error.strerror}"
            ) from error
        finally:
            os.close(fd)
        tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
        self._files[tensor.data_ptr()] = (n, dtype, tuple(shape))
        return tensor

    def export(self, kv_caches: list[KVCache], layout: KVLayout) -> KVSource:
        files = []
        for tensor in _flat(kv_caches):
            entry = self._files.get(tensor.data_ptr())
            if entry is None or entry[2] != tuple(tensor.shape) or entry[1] != tensor.dtype:
                raise ValueError("a KV tensor to export was not allocated whole by this transport's zeros()")
            files.append(entry)
        return KVSource(self.name, encode_address(self.directory, self.prefix, files), layout)

    def start_load(self, load: KVLoad, kv_caches: list[KVCache]) -> None:
        try:
            if not isinstance(load.source, KVSource) or load.source.transport != self.name:
                raise _LoadError(f"not a {self.name} source: {load.source!r}")
            source = self._source(load.source.address)
            self._check(source, kv_caches, load)
        except _LoadError as error:
            self._results.append(KVLoadResult(load.request_id, 0, str(error)))
            return
        copy_blocks(_like(kv_caches, source), kv_caches, load.remote_block_ids, load.local_block_ids)
        self._results.append(KVLoadResult(load.request_id, len(load.local_block_ids)))

    def _source(self, address: str) -> list[torch.Tensor]:
        """The source's tensors, mapped on first use; refused once its files are gone."""
        mapping = self._mappings.get(address)
        if mapping is None:
            files = decode_address(address)
            try:
                mapped = [_map_read_only(file) for file in files]
            except (OSError, ValueError) as error:
                raise _LoadError(f"cannot open the source's files (its engine closed or died?): {error}") from error
            mapping = _Mapping(files, [tensor for tensor, _ in mapped], [identity for _, identity in mapped])
            self._mappings[address] = mapping
            return mapping.tensors
        for file, identity in zip(mapping.files, mapping.identities):
            try:
                stat = os.stat(file.path)
            except OSError:
                stat = None
            if stat is None or (stat.st_dev, stat.st_ino) != identity:
                del self._mappings[address]
                raise _LoadError(f"the source's files are gone ({file.path}): its engine closed or died")
        return mapping.tensors

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
        """Unlink our files (our own tensors stay usable) and drop the sources' mappings."""
        _unlink_all(self._paths)
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


def remove_source_files(source: KVSource) -> None:
    """Remove the files of a source whose engine died without closing its transport (a
    SIGKILL): tmpfs pages are memory until their files go. Readers that mapped them report
    the source gone at their next load."""
    try:
        files = decode_address(source.address)
    except _LoadError:
        return
    _unlink_all([file.path for file in files])
