"""Tensors that are views of a memory-mapped file: a checkpoint's safetensors, or the
spill file quantized experts are written to. Reading a view faults its pages in from the
page cache or the disk; ``release`` hands them back, so the process's resident memory
holds only what it copied out."""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import torch

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class MappedTensor:
    """A tensor viewing ``nbytes`` of ``file`` from byte ``offset``."""

    file: MappedFile
    offset: int
    nbytes: int
    tensor: torch.Tensor

    def release(self) -> None:
        self.file.release(self.offset, self.nbytes)


class MappedFile:
    """One file mapped copy-on-write (views are writable, so torch takes them without a
    copy; nothing writes them, so every page stays the file's)."""

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            self.map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None

    def view(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> MappedTensor:
        count = 1
        for dim in shape:
            count *= dim
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if self.map is None or count == 0:
            return MappedTensor(self, offset, 0, torch.empty(shape, dtype=dtype))
        flat = torch.frombuffer(self.map, dtype=dtype, count=count, offset=offset)
        return MappedTensor(self, offset, nbytes, flat.view(shape))

    def release(self, offset: int = 0, nbytes: int | None = None) -> None:
        """Drop the pages of ``[offset, offset + nbytes)`` from this process (the page
        cache may keep them); the whole file when ``nbytes`` is None."""
        if self.map is None:
            return
        end = len(self.map) if nbytes is None else offset + nbytes
        start = offset - offset % mmap.PAGESIZE
        if end > start:
            self.map.madvise(mmap.MADV_DONTNEED, start, end - start)


def mapped_safetensors(path: str) -> Iterator[tuple[str, MappedTensor]]:
    """Every tensor of one .safetensors file as a mapped view, in header order: an 8-byte
    little-endian header length, a JSON header of dtypes, shapes and byte ranges, then
    the data."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header: dict[str, dict[str, object]] = json.loads(f.read(header_len))
    file = MappedFile(path)
    data_start = 8 + header_len
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype_name = str(entry["dtype"])
        if dtype_name not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dtype_name}, which cannot be mapped")
        offsets = entry["data_offsets"]
        assert isinstance(offsets, list)
        begin = int(offsets[0])
        shape = tuple(int(d) for d in entry["shape"])  # type: ignore[attr-defined]
        yield name, file.view(data_start + begin, _SAFETENSORS_DTYPES[dtype_name], shape)
